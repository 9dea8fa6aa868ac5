"""Assemble a Cubelet from command-line choices: store, backend, host, shim driver."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from cubeaccel.backends.base import Backend
from cubeaccel.cubelet.lifecycle import Cubelet, CubeletConfig
from cubeaccel.cubelet.shim_driver import ShimDriver, SimulatedShimDriver
from cubeaccel.cubelet.store import Store
from cubeaccel.model.errors import invalid

BACKENDS = ("simulated", "vfio", "emulated")
SIMULATED_ALLOW = ("10de:*", "1234:11e8")


@dataclass(frozen=True)
class RuntimeOptions:
    state_dir: Path
    backend: str = "simulated"
    profile: str = "h100x8"
    sysfs_root: Path = Path("/sys")
    dev_root: Path = Path("/dev")  # host readiness only (fake trees in tests); holders are always read in /proc
    proc_root: Path = Path("/proc")
    allow: tuple[str, ...] = ("10de:*",)
    config: CubeletConfig = field(default_factory=CubeletConfig)
    vm_start: str = "template"  # real shims: start from the template snapshot, or cold boot
    detach_timeout_s: float = 10.0  # real shims: how long to wait for DEVICE_DELETED


def build_cubelet(opts: RuntimeOptions) -> Cubelet:
    if opts.vm_start not in ("template", "cold"):
        raise invalid("cubelet.invalid_vm_start", f"--vm-start must be template or cold, not {opts.vm_start!r}")
    if opts.backend not in BACKENDS:
        raise invalid("cubelet.unknown_backend", f"unknown backend {opts.backend!r}; known: {list(BACKENDS)}",
                      layer="backend")
    opts.state_dir.mkdir(parents=True, exist_ok=True)
    opts.state_dir.chmod(0o700)  # the unix socket in it carries shim reports and operator verbs
    store = Store(opts.state_dir / "cubelet.db")
    backend: Backend
    shim: ShimDriver
    if opts.backend == "simulated":
        from cubeaccel.backends.vfio import VfioBackend
        from cubeaccel.host.simulated import SimulatedPciHost

        host = SimulatedPciHost(opts.profile, opts.state_dir / "simulated-host.json")
        backend = VfioBackend(host, allow=SIMULATED_ALLOW)
        shim = SimulatedShimDriver(host)
    elif opts.backend == "vfio":
        from cubeaccel.backends.vfio import VfioBackend
        from cubeaccel.cubelet.process_shim import ProcessShimDriver
        from cubeaccel.host.pci import SysfsPciHost
        from cubeaccel.host.readiness import HostRoots

        roots = HostRoots(opts.sysfs_root, opts.dev_root, opts.proc_root)
        backend = VfioBackend(SysfsPciHost(str(opts.sysfs_root)), allow=opts.allow, readiness_roots=roots)
        shim = ProcessShimDriver(opts.state_dir, start_mode=opts.vm_start, detach_timeout_s=opts.detach_timeout_s)
    else:
        from cubeaccel.backends.emulated import EmulatedBackend
        from cubeaccel.cubelet.process_shim import ProcessShimDriver

        backend = EmulatedBackend()
        shim = ProcessShimDriver(opts.state_dir, start_mode=opts.vm_start, detach_timeout_s=opts.detach_timeout_s)
    return Cubelet(store, backend, shim, opts.config)
