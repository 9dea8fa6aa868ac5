"""What the shim needs from a VMM (today QEMU, `shim/qemu.py`; docs/decisions.md says why only QEMU).

A `Vmm` starts one MicroVM, adds and removes devices, reports removal only when the VMM says it happened
(QEMU `DEVICE_DELETED`), and stops the process, returning how it exited.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from cubeaccel.model.bars import MachineShape, machine_shape
from cubeaccel.protocol.errors import CubeError
from cubeaccel.wire.shim_spec import MAX_DEVICES


def vmm_error(code: str, message: str, layer: str = "backend", **details: Any) -> CubeError:
    return CubeError(code=code, message=message, layer=layer, details=dict(details), status=500)


@dataclass(frozen=True)
class VmConfig:
    """One VM's machine. Everything that shapes migration state is here, so a template matches its sandboxes."""

    sandbox_id: str
    memory_mib: int
    vcpus: int
    pin_memory: bool
    kernel: Path
    initrd: Path
    cmdline: str
    state_dir: Path
    root_ports: int = MAX_DEVICES  # one hot-plug slot per device the spec may carry
    # Windows per root port, the 64-bit hole and address bits, sized from the devices' BARs (model/bars.py);
    # None: the shape of a machine no device asks more of.
    shape: MachineShape | None = None
    memory_backend: str = "ram"  # ram | memfd | hugepages (memfd on 2 MiB hugetlbfs pages; needs a hugepage pool)
    # Host-side only (not migrated, so not in the template key): threads touching guest RAM at start, and the
    # host NUMA node holding it and them (model/pinned_memory.py `prealloc_threads`, `numa_bind_node`).
    prealloc_threads: int = 1
    host_node: int | None = None
    device_ids: tuple[str, ...] = ()  # Cubelet device ids this VMM may hold (tagged for holder lookups)
    vfio_hosts: tuple[str, ...] = ()  # host PCI addresses of its vfio-pci devices: their group nodes are exposed
    memory_files: tuple[str, ...] = ()  # its devices' memory files (hot-plugged later; QEMU opens them by name)
    # Sandbox policy (model/sandbox_policy.py). A NIC, disk or mount changes the machine, so such a VM is always
    # cold-booted, never restored from a template state.
    tap_fd: int | None = None  # an open TAP in the sandbox's network namespace (host/net/netpolicy.open_tap)
    mac: str | None = None
    guest_net: str | None = None  # "ADDR/PREFIX,GATEWAY", told to the guest on its command line
    # fds on the workload's capped disk (host/vmm/scratch.py): read-write, and read-only (QEMU opens an image
    # read-only first, and an fd set answers only with an fd of the asked access mode)
    scratch_fd: int | None = None
    scratch_ro_fd: int | None = None
    ro_mounts: tuple[tuple[str, str], ...] = ()  # (host directory, guest directory), shared read-only (9p)

    @property
    def machine(self) -> MachineShape:
        return self.shape or machine_shape([], self.root_ports, self.memory_mib)

    @property
    def policy_devices(self) -> bool:
        return self.tap_fd is not None or self.scratch_fd is not None or bool(self.ro_mounts)

    @property
    def inherited_fds(self) -> tuple[int, ...]:
        """Descriptors the VMM must inherit for the policy devices (a confined VMM opens no host file itself)."""
        return tuple(fd for fd in (self.tap_fd, self.scratch_fd, self.scratch_ro_fd) if fd is not None)

    def guest_cmdline(self) -> str:
        """What the guest's init reads from /proc/cmdline to bring up the policy devices (images/rootfs.py)."""
        args = []
        if self.guest_net:
            args.append(f"cube.net={self.guest_net}")
        if self.scratch_fd is not None:
            args.append("cube.scratch=vda")
        if self.ro_mounts:
            args.append("cube.ro=" + ",".join(f"cube-ro{i}:{target}" for i, (_, target) in enumerate(self.ro_mounts)))
        return " ".join(args)


@dataclass(frozen=True)
class ExitInfo:
    pid: int
    status: int  # raw wait status
    exit_code: int | None
    signal: int | None
    how: str  # exited | quit | sigterm | sigkill

    @classmethod
    def from_wait(cls, pid: int, status: int, how: str) -> ExitInfo:
        if os.WIFSIGNALED(status):
            return cls(pid, status, None, os.WTERMSIG(status), how)
        return cls(pid, status, os.WEXITSTATUS(status), None, how)

    def to_json(self) -> dict[str, object]:
        return {
            "pid": self.pid,
            "status": self.status,
            "exit_code": self.exit_code,
            "signal": self.signal,
            "how": self.how,
        }


REAP_AFTER_KILL_S = 30.0


def stop_child(
    proc: subprocess.Popen[bytes], poll_exit: Callable[[], ExitInfo | None], ask: Callable[[], None], grace_s: float
) -> ExitInfo:
    """Ask the VMM to quit (`ask` raises CubeError when it cannot), SIGTERM if asking failed, SIGKILL after
    `grace_s`; returns only once the process was waited for, saying how it went."""
    known = poll_exit()
    if known is not None:
        return known
    how = "quit"
    try:
        ask()
    except CubeError:
        how = "sigterm"
        os.kill(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while (known := poll_exit()) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    if known is None:
        os.kill(proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + REAP_AFTER_KILL_S
        while (known := poll_exit()) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if known is None:  # stuck in the kernel (D state): its exit is NOT confirmed, and never claimed
            return ExitInfo(proc.pid, -1, None, None, "unreaped")
        return ExitInfo(known.pid, known.status, known.exit_code, known.signal, "sigkill")
    return ExitInfo(known.pid, known.status, known.exit_code, known.signal, how)


def reap(proc: subprocess.Popen[bytes] | None, known: ExitInfo | None) -> ExitInfo | None:
    """Non-blocking waitpid of a VMM child: its exit is learned once, from the kernel, never assumed."""
    if known is None and proc is not None:
        pid, status = os.waitpid(proc.pid, os.WNOHANG)
        if pid:
            proc.returncode = status
            return ExitInfo.from_wait(pid, status, "exited")
    return known


@dataclass(frozen=True)
class Attached:
    qdev_id: str
    bus: str


class Vmm(Protocol):
    kind: str  # "qemu"

    @property
    def pid(self) -> int: ...

    def start(self) -> None:
        """Launch (cold boot, or restore when configured); returns once the control channel answers."""
        ...

    def add_device(self, qdev_id: str, driver: str, properties: dict[str, str], slot: int) -> Attached: ...

    def request_remove(self, qdev_id: str) -> None:
        """Ask for removal. Never means the device is gone."""
        ...

    def wait_removed(self, qdev_ids: set[str], timeout_s: float) -> set[str]:
        """Wait (bounded) for the VMM's removal events; returns the ids confirmed removed."""
        ...

    def poll_exit(self) -> ExitInfo | None: ...

    def stop(self, grace_s: float) -> ExitInfo:
        """Graceful quit, then SIGKILL after `grace_s`; returns only after the process was waited for."""
        ...
