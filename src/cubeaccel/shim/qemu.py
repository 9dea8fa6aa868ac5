"""`QemuVmm`: one QEMU MicroVM driven over QMP (qemu.qmp's synchronous client).

Machine: q35 with ACPI PCI hot-plug on `pcie-root-port`s (native pciehp costs ~6 s per unplug), guest RAM from a
preallocated memory backend locked with `-overcommit mem-lock=on`, virtio-serial ports for cube-agent and for the
workload service, the serial
console in a log file, and the sandbox tag on the command line. KVM when it can really run a guest, otherwise TCG
with a 64 MiB translation cache (the default 1 GiB would be locked too). Template state is saved and restored
by migration to and from a file (`exec:cat`).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from qemu.qmp import ExecuteError, QMPError
from qemu.qmp.legacy import QEMUMonitorProtocol

from cubeaccel.host import vmmproc as find
from cubeaccel.host.hypervisor import detect_accel, find_qemu
from cubeaccel.host.unix_path import connect_path
from cubeaccel.model.agent_protocol import AGENT_PORT_NAME
from cubeaccel.model.errors import CubeError
from cubeaccel.model.mux import WORKLOAD_PORT_NAME
from cubeaccel.shim import snapshot_guard as guard
from cubeaccel.shim.memory import pinned_error
from cubeaccel.shim.vmm import Attached, ExitInfo, VmConfig, Vmm, reap, stop_child, vmm_error

QMP_TIMEOUT_S = 10.0


def qemu_binary() -> str:
    path = find_qemu()
    if not path:
        raise vmm_error("vmm.qemu_missing", "qemu-system-x86_64 not found (apt-get install qemu-system-x86)")
    return path


def memory_object(cfg: VmConfig) -> str:
    """The guest RAM backend: always preallocated; memfd/hugepages when the spec asks for them."""
    size = f"id=m0,size={cfg.memory_mib}M,prealloc=on"
    if cfg.memory_backend == "memfd":
        return f"memory-backend-memfd,{size}"
    if cfg.memory_backend == "hugepages":
        return f"memory-backend-memfd,{size},hugetlb=on,hugetlbsize=2M"
    return f"memory-backend-ram,{size}"


def build_argv(cfg: VmConfig, accel: str, incoming: bool = False) -> list[str]:
    """The full QEMU command line. Pure: unit tests read it, and template save/restore must produce the same one."""
    sd = cfg.state_dir
    cmdline = f"{cfg.cmdline} pci=hpmmioprefsize={cfg.bar_window_gib}G"
    if extra := cfg.guest_cmdline():
        cmdline += " " + extra
    argv = [
        qemu_binary(),
        "-name",
        find.name_arg(cfg.sandbox_id),
        "-machine",
        "q35,memory-backend=m0",
        "-accel",
        "kvm" if accel == "kvm" else "tcg,tb-size=64",
        "-smp",
        str(cfg.vcpus),
        "-m",
        f"{cfg.memory_mib}M",
        "-object",
        memory_object(cfg),
        "-nodefaults",
        "-no-user-config",
        "-display",
        "none",
        "-no-reboot",
        "-kernel",
        str(cfg.kernel),
        "-initrd",
        str(cfg.initrd),
        "-append",
        cmdline,
        "-chardev",
        f"file,id=con0,path={sd / 'console.log'}",
        "-serial",
        "chardev:con0",
        "-device",
        "virtio-serial-pci,id=vser0",
        # Sockets by names relative to the VMM's cwd (its state dir): a full path may pass AF_UNIX's 108 bytes.
        "-chardev",
        "socket,id=agent0,path=agent.sock,server=on,wait=off",
        "-device",
        f"virtserialport,bus=vser0.0,chardev=agent0,name={AGENT_PORT_NAME}",
        # The workload's own port: a workload never shares a channel with validation.
        "-chardev",
        "socket,id=workload0,path=workload-vmm.sock,server=on,wait=off",
        "-device",
        f"virtserialport,bus=vser0.0,chardev=workload0,name={WORKLOAD_PORT_NAME}",
        "-qmp",
        "unix:qmp.sock,server=on,wait=off",
        # A second monitor for Cubelet/operators while the shim holds the first.
        "-qmp",
        "unix:qmp-aux.sock,server=on,wait=off",
    ]
    if accel == "kvm":
        argv += ["-cpu", "host"]
    if cfg.pin_memory:
        argv += ["-overcommit", "mem-lock=on"]
    for i in range(cfg.root_ports):
        argv += [
            "-device",
            f"pcie-root-port,id=rp{i + 1},chassis={i + 1},slot={i + 1},pref64-reserve={cfg.bar_window_gib}G",
        ]
    argv += policy_argv(cfg)
    if incoming:
        argv += ["-incoming", "defer"]
    return argv


def policy_argv(cfg: VmConfig) -> list[str]:
    """The sandbox policy's devices, on the root complex (the root ports stay free for hot-plug).

    The NIC is an fd QEMU inherits (no /dev/net/tun, no CAP_NET_ADMIN in the VMM) with no option ROM (no
    firmware file to read); the scratch disk likewise inherited fds (`-add-fd`, opened as `/dev/fdset/N`), so a
    confined VMM opens no host file for either; read-only mounts are 9p shares QEMU itself refuses to write
    (`readonly=on`), whose source a confined VMM must see."""
    argv: list[str] = []
    fdset = 9  # an fd set of its own, apart from any the launch path uses
    if cfg.tap_fd is not None:
        argv += [
            "-netdev",
            f"tap,id=net0,fd={cfg.tap_fd},vhost=off",
            "-device",
            f"virtio-net-pci,netdev=net0,mac={cfg.mac},romfile=",
        ]
    if cfg.scratch_fd is not None:
        argv += [
            "-add-fd",
            f"fd={cfg.scratch_fd},set={fdset},opaque=scratch.img",
            *(["-add-fd", f"fd={cfg.scratch_ro_fd},set={fdset},opaque=scratch.img"] if cfg.scratch_ro_fd else []),
            "-drive",
            f"file=/dev/fdset/{fdset},if=none,id=scratch0,format=raw,discard=unmap",
            "-device",
            "virtio-blk-pci,drive=scratch0,serial=cube-scratch",
        ]
    for i, (source, _target) in enumerate(cfg.ro_mounts):
        argv += [
            "-fsdev",
            f"local,id=ro{i},path={source},security_model=none,readonly=on",
            "-device",
            f"virtio-9p-pci,fsdev=ro{i},mount_tag=cube-ro{i}",
        ]
    return argv


class QemuVmm:
    kind = "qemu"

    def __init__(self, cfg: VmConfig, restore_from: Path | None = None) -> None:
        self.cfg = cfg
        self.restore_from = restore_from
        self.accel, self.accel_reason = detect_accel()
        self._proc: subprocess.Popen[bytes] | None = None
        self._qmp: QEMUMonitorProtocol | None = None
        self._exit: ExitInfo | None = None
        self._attached: dict[str, Attached] = {}
        self._deleted: set[str] = set()
        self.timings: dict[str, float] = {}

    # -- process ---------------------------------------------------------------------------------------------
    @property
    def started(self) -> bool:
        """A process exists (even if the rest of start failed): it must be stopped and waited for."""
        return self._proc is not None

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise vmm_error("vmm.not_started", "VMM not started")
        return self._proc.pid

    def start(self) -> None:
        sd = self.cfg.state_dir
        sd.mkdir(parents=True, exist_ok=True)
        for name in ("qmp.sock", "qmp-aux.sock", "agent.sock", "workload-vmm.sock"):
            (sd / name).unlink(missing_ok=True)
        argv = build_argv(self.cfg, self.accel, incoming=self.restore_from is not None)
        env = {**os.environ, find.ENV_SANDBOX: self.cfg.sandbox_id, find.ENV_DEVICES: ";".join(self.cfg.device_ids)}
        t0 = time.monotonic()
        with (sd / "vmm.log").open("ab") as log:
            # Own session: the VMM must outlive a killed shim so Cubelet can find it by pid + tag.
            self._proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                env=env,
                start_new_session=True,
                cwd=sd,
                pass_fds=self.cfg.inherited_fds,
            )
        (sd / "vmm.pid").write_text(f"{self._proc.pid}\n")
        self._connect(t0)
        self.timings["spawn_to_qmp_s"] = time.monotonic() - t0
        if self.restore_from is not None:
            t1 = time.monotonic()
            self._restore(self.restore_from)
            self.timings["restore_s"] = time.monotonic() - t1

    def _log_tail(self) -> str:
        try:
            return (self.cfg.state_dir / "vmm.log").read_text(errors="replace")[-1000:]
        except OSError:
            return ""

    def _early_exit(self) -> CubeError:
        info = self.poll_exit()
        tail = self._log_tail()
        if "mlock" in tail or "locking memory" in tail:
            return pinned_error(
                "pinned_memory.lock_failed",
                f"VMM could not lock guest memory: {tail.strip()[-300:]}",
                exit=info.to_json() if info else None,
            )
        return vmm_error(
            "vmm.start_failed",
            f"QEMU exited during start: {tail.strip()[-500:]}",
            exit=info.to_json() if info else None,
        )

    def _connect(self, t0: float) -> None:
        sock = self.cfg.state_dir / "qmp.sock"
        deadline = t0 + 60.0  # prealloc of large guests under cold host memory takes seconds per GiB
        while True:
            if self.poll_exit() is not None:
                raise self._early_exit()
            if sock.exists():
                qmp = QEMUMonitorProtocol(connect_path(sock))
                try:
                    qmp.connect()
                except (QMPError, OSError):
                    pass
                else:
                    qmp.settimeout(QMP_TIMEOUT_S)
                    self._qmp = qmp
                    return
            if time.monotonic() > deadline:
                raise vmm_error("vmm.qmp_timeout", "QMP socket did not answer within 60 s")
            time.sleep(0.02)

    def qmp(self, command: str, **args: Any) -> Any:
        if self._qmp is None:
            raise vmm_error("vmm.not_started", "QMP not connected")
        try:
            return self._qmp.cmd(command, **args)
        except ExecuteError as e:
            raise vmm_error("vmm.qmp_error", f"{command}: {e.error.error.desc}", qmp_class=e.error_class) from e
        except (QMPError, OSError, TimeoutError, EOFError, RuntimeError) as e:
            raise vmm_error("vmm.qmp_failed", f"{command}: {type(e).__name__}: {e}") from e

    def _wait_status(self, wanted: set[str], timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            status = str(self.qmp("query-status")["status"])
            if status in wanted:
                return status
            if time.monotonic() > deadline:
                raise vmm_error("vmm.status_timeout", f"VM status {status}, wanted {sorted(wanted)}")
            time.sleep(0.01)

    def _restore(self, state: Path) -> None:
        self.qmp("migrate-incoming", uri=f"exec:cat {state}")
        self._wait_status({"paused", "postmigrate"}, 60.0)
        mig = self.qmp("query-migrate")
        if mig.get("status") not in (None, "completed"):
            raise vmm_error("vmm.restore_failed", f"restore from {state}: migration {mig.get('status')}")
        self.qmp("cont")

    def save_state(self, dest: Path, timeout_s: float = 60.0) -> None:
        """Pause and write the VM's state to `dest`. Refused while any device is attached, by our own record or
        by QEMU's answer before and after the migration (the state file is then never put in place)."""
        if self._attached:
            raise CubeError(
                "lifecycle.snapshot_with_device",
                "a VM with a device attached is never snapshotted",
                layer="backend",
                details={"devices": sorted(self._attached)},
                status=409,
            )
        tmp = dest.with_suffix(".partial")
        self.qmp("stop")
        self.refuse_foreign_devices()
        try:
            self.qmp("migrate", uri=f"exec:cat > {tmp}")
            deadline = time.monotonic() + timeout_s
            while True:
                status = self.qmp("query-migrate").get("status")
                if status == "completed":
                    break
                if status in ("failed", "cancelled") or time.monotonic() > deadline:
                    raise vmm_error("vmm.save_failed", f"template save: migration {status}")
                time.sleep(0.02)
            self.refuse_foreign_devices()  # nothing was added over another monitor while it was written
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        tmp.replace(dest)

    def refuse_foreign_devices(self) -> None:
        """Ask QEMU itself what the machine holds (`query-pci` and QOM), refusing anything not in the template."""
        found = guard.foreign_pci(self.qmp("query-pci"))
        for path in guard.QOM_DEVICE_PATHS:
            found += guard.foreign_qom(path, self.qmp("qom-list", path=path))
        if found:
            raise guard.snapshot_refused(found)

    # -- devices ---------------------------------------------------------------------------------------------
    def add_device(self, qdev_id: str, driver: str, properties: dict[str, str], slot: int) -> Attached:
        bus = f"rp{slot + 1}"
        self.qmp("device_add", driver=driver, id=qdev_id, bus=bus, **properties)
        att = Attached(qdev_id, bus)
        self._attached[qdev_id] = att
        return att

    def request_remove(self, qdev_id: str) -> None:
        self.qmp("device_del", id=qdev_id)

    def _drain(self, wait: float) -> None:
        if self._qmp is None:
            return
        try:
            ev = self._qmp.pull_event(wait=wait) if wait > 0 else self._qmp.pull_event(wait=False)
        except (TimeoutError, QMPError, OSError, EOFError, RuntimeError):
            return
        while ev is not None:
            if ev.get("event") == "DEVICE_DELETED" and (dev := ev.get("data", {}).get("device")):
                self._deleted.add(str(dev))
                self._attached.pop(str(dev), None)
            try:
                ev = self._qmp.pull_event(wait=False)
            except (QMPError, OSError, EOFError, RuntimeError):
                return

    def wait_removed(self, qdev_ids: set[str], timeout_s: float) -> set[str]:
        deadline = time.monotonic() + timeout_s
        while True:
            self._drain(0.0)
            done = qdev_ids & self._deleted
            left = deadline - time.monotonic()
            if done == qdev_ids or left <= 0 or self.poll_exit() is not None:
                return done
            self._drain(min(0.2, left))

    @property
    def attached(self) -> dict[str, Attached]:
        return dict(self._attached)

    # -- exit ------------------------------------------------------------------------------------------------
    def poll_exit(self) -> ExitInfo | None:
        self._exit = reap(self._proc, self._exit)
        return self._exit

    def stop(self, grace_s: float = 5.0) -> ExitInfo:
        if self._proc is None:
            raise vmm_error("vmm.not_started", "VMM not started")
        if self.poll_exit() is None:
            self._exit = stop_child(self._proc, self.poll_exit, lambda: self.qmp("quit"), grace_s)
        self.close()
        assert self._exit is not None
        return self._exit

    def close(self) -> None:
        if self._qmp is not None:
            with contextlib.suppress(QMPError, OSError, RuntimeError, EOFError):
                self._qmp.close()
            self._qmp = None


def _conforms(vmm: QemuVmm) -> Vmm:
    """mypy --strict checks here that QemuVmm implements the Vmm protocol."""
    return vmm
