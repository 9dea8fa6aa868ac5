"""Builds a real Cubelet (real SQLite store, real VFIO backend logic) on the simulated host."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cubeaccel.backends.vfio import VfioBackend
from cubeaccel.cubelet.inventory import initialize_host
from cubeaccel.cubelet.lifecycle import Cubelet, CubeletConfig
from cubeaccel.cubelet.reconcile import Repair, reconcile
from cubeaccel.cubelet.shim_driver import SimulatedShimDriver
from cubeaccel.cubelet.store import Store
from cubeaccel.host.pci.simulated import SimulatedPciHost
from cubeaccel.model.device import DeviceRecord, PciAddress
from cubeaccel.model.states import DeviceState


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, s: float) -> None:
        self.now += s


@dataclass
class Node:
    """One simulated node; `restart()` models a Cubelet crash: new process, same disk and hardware."""

    dir: Path
    profile: str
    clock: Clock
    host: SimulatedPciHost
    shim: SimulatedShimDriver
    cubelet: Cubelet
    config: CubeletConfig

    @classmethod
    def create(cls, dir: Path, profile: str = "h100x8", config: CubeletConfig | None = None) -> Node:
        clock = Clock()
        cfg = config or CubeletConfig(reservation_ttl_s=60, release_timeout_s=10, pinnable_memory_mib=1 << 20)
        host = SimulatedPciHost(profile, dir / "host.json")
        node = cls(dir, profile, clock, host, SimulatedShimDriver(host), None, cfg)  # type: ignore[arg-type]
        node.cubelet = node._build()
        initialize_host(node.cubelet)
        assert reconcile(node.cubelet) == []
        return node

    def _build(self) -> Cubelet:
        store = Store(self.dir / "cubelet.db", clock=self.clock)
        return Cubelet(store, VfioBackend(self.host, allow=("10de:*", "1234:11e8")), self.shim, self.config)

    def restart(self) -> list[Repair]:
        self.cubelet.store.close()
        self.host = SimulatedPciHost(self.profile, self.dir / "host.json")
        old = self.shim
        self.shim = SimulatedShimDriver(
            self.host,
            fail_attach=old.fail_attach,
            uncooperative_guest=old.uncooperative_guest,
            immortal_vmm=old.immortal_vmm,
            failed_guest_validation=old.failed_guest_validation,
        )
        self.cubelet = self._build()
        initialize_host(self.cubelet)
        return reconcile(self.cubelet)

    def devices(self) -> list[DeviceRecord]:
        return self.cubelet.store.devices()

    def states(self) -> dict[str, DeviceState]:
        return {d.id: d.state for d in self.devices()}

    def device(self, device_id: str) -> DeviceRecord:
        d = self.cubelet.store.device(device_id)
        assert d is not None
        return d

    def address(self, device_id: str) -> PciAddress:
        return self.device(device_id).address

    def kinds(self, sandbox_id: str | None = None) -> list[str]:
        return [e.kind for e in self.cubelet.store.events() if sandbox_id is None or e.sandbox_id == sandbox_id]

    def repairs(self) -> list[str]:
        return [str(e.details.get("what")) for e in self.cubelet.store.events() if e.kind == "reconcile_repair"]
