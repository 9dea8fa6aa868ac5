"""Backend capabilities beyond `Backend` are decided once, when Cubelet is given the backend, and Cubelet acts on
exactly what was decided: VFIO binds, restores and tracks AER baselines; emulated does none of it."""

from __future__ import annotations

from pathlib import Path

from cubeaccel.backends.base import AerBaselines, Capabilities, HostBinding
from cubeaccel.backends.emulated import EmulatedBackend
from cubeaccel.backends.vfio import VfioBackend
from cubeaccel.cubelet import operator
from cubeaccel.cubelet.inventory import initialize_host
from cubeaccel.cubelet.lifecycle import Cubelet, CubeletConfig
from cubeaccel.cubelet.runtime import assemble
from cubeaccel.cubelet.shim_driver import SimulatedShimDriver
from cubeaccel.cubelet.store import Store
from cubeaccel.host.pci.simulated import SimulatedPciHost
from cubeaccel.model.device import PciAddress
from cubeaccel.model.states import DeviceState


def test_vfio_has_binding_and_aer_emulated_has_neither(tmp_path: Path) -> None:
    vfio = VfioBackend(SimulatedPciHost("h100x2", tmp_path / "host.json"))
    caps = Capabilities.of(vfio)
    assert caps.binding is vfio and caps.aer is vfio
    assert Capabilities.of(EmulatedBackend("capstest")) == Capabilities(binding=None, aer=None)


def test_a_partial_implementation_is_not_a_capability() -> None:
    class BindsButCannotRestore:
        expected_driver = "vfio-pci"

        def prepare(self, device: object) -> None: ...

    class CountsButCannotAccept:
        def aer_baselines(self) -> dict[PciAddress, int]:
            return {}

        def set_aer_baseline(self, address: PciAddress, count: int) -> None: ...

    assert not isinstance(BindsButCannotRestore(), HostBinding)
    assert not isinstance(CountsButCannotAccept(), AerBaselines)


def _kinds(c: Cubelet) -> list[str]:
    return [e.kind for e in c.store.events(0, 10000)]


def test_emulated_devices_expect_no_driver_and_disable_restores_nothing(tmp_path: Path) -> None:
    host = SimulatedPciHost("h100x2", tmp_path / "host.json")  # only for the shim driver; the devices are edu
    c = assemble(Store(tmp_path / "c.db"), EmulatedBackend("capstest"), SimulatedShimDriver(host), CubeletConfig())
    initialize_host(c)
    devices = c.store.devices()
    assert devices and all(d.expected_driver is None for d in devices)
    d = operator.disable(c, devices[0].id, who="test", why="capabilities", restore_driver=True)
    assert d.state is DeviceState.DISABLED
    assert not {"driver_restored", "driver_restore_failed"} & set(_kinds(c))


def test_vfio_devices_expect_vfio_pci_and_disable_asks_for_the_driver_back(tmp_path: Path) -> None:
    host = SimulatedPciHost("h100x2", tmp_path / "host.json")
    c = assemble(Store(tmp_path / "c.db"), VfioBackend(host), SimulatedShimDriver(host), CubeletConfig())
    initialize_host(c)
    devices = c.store.devices()
    assert devices and all(d.expected_driver == "vfio-pci" for d in devices)
    operator.disable(c, devices[0].id, who="test", why="capabilities", restore_driver=True)
    assert {"driver_restored", "driver_restore_failed"} & set(_kinds(c))
