"""`QemuVmm`: one QEMU MicroVM driven over QMP (qemu.qmp's synchronous client).

Machine: q35 with ACPI PCI hot-plug on `pcie-root-port`s (native pciehp costs ~6 s per unplug), guest RAM from a
preallocated memory backend locked with `-overcommit mem-lock=on`, virtio-serial ports for cube-agent and for the
workload service, the serial
console in a log file, and the sandbox tag on the command line. KVM when it can really run a guest, otherwise TCG
with a 64 MiB translation cache (the default 1 GiB would be locked too). Template state is saved and restored
by migration to and from a file the shim opens and hands over QMP (`getfd`, `fd:`).

Confined (docs/security.md): QEMU runs as its own uid with no capabilities (or exactly CAP_IPC_LOCK where the host
cannot raise RLIMIT_MEMLOCK), under `-sandbox` (seccomp), in a mount namespace holding only what `vmm_exposure`
names. It has no writable file: the shim creates the listening sockets, the console log and the migration file
and passes descriptors, so every socket keeps its path in the state dir, owned by root.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qemu.qmp import ExecuteError, QMPError
from qemu.qmp.legacy import QEMUMonitorProtocol

from cubeaccel.host.service import childenv
from cubeaccel.host.service.unix_path import connect_path
from cubeaccel.host.vmm import confine
from cubeaccel.host.vmm import vmmproc as find
from cubeaccel.host.vmm.hypervisor import detect_accel, find_qemu, host_phys_bits, numa_nodes
from cubeaccel.model.bars import DEFAULT_MEM32_WINDOW, DEFAULT_PHYS_BITS, DEFAULT_PREF64_WINDOW
from cubeaccel.model.pinned_memory import TCG_CACHE_MIB, LockedGuest
from cubeaccel.model.start_deadlines import StartDeadlines, start_deadlines
from cubeaccel.protocol.agent_protocol import AGENT_PORT_NAME
from cubeaccel.protocol.errors import CubeError
from cubeaccel.protocol.mux import WORKLOAD_PORT_NAME
from cubeaccel.shim import snapshot_guard as guard
from cubeaccel.shim.confined import VMM_ROOT_DIR, VmmExposure, launch_argv, vmm_exposure
from cubeaccel.shim.console import CONSOLE_LOG, open_console
from cubeaccel.shim.memory import pinned_error
from cubeaccel.shim.vmm import Attached, ExitInfo, VmConfig, Vmm, reap, stop_child, vmm_error

QMP_TIMEOUT_S = 10.0
SANDBOX_ARG = "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"
SOCKETS = ("qmp.sock", "qmp-aux.sock", "agent.sock", "workload-vmm.sock")
MIGRATION_FD = "migration"
PREALLOC_CONTEXT = "tc0"


@dataclass(frozen=True)
class VmmFds:
    """Descriptors the VMM inherits: listening sockets (their files in the state dir) and the console log."""

    qmp: int
    qmp_aux: int
    agent: int
    workload: int
    console: int

    def all(self) -> tuple[int, ...]:
        return (self.qmp, self.qmp_aux, self.agent, self.workload, self.console)


SHAPE_FDS = VmmFds(3, 4, 5, 6, 7)  # placeholders for a command line that is only read, never run


def qemu_binary() -> str:
    path = find_qemu()
    if not path:
        raise vmm_error("vmm.qemu_missing", "qemu-system-x86_64 not found (apt-get install qemu-system-x86)")
    return path


def memory_object(cfg: VmConfig) -> str:
    """The guest RAM backend: always preallocated (by `prealloc_threads` threads); memfd/hugepages when the spec
    asks for them; on a NUMA host, bound to the devices' node, touched by threads running there."""
    size = f"id=m0,size={cfg.memory_mib}M,prealloc=on"
    if cfg.prealloc_threads > 1:
        size += f",prealloc-threads={cfg.prealloc_threads}"
    if cfg.host_node is not None:
        size += f",host-nodes={cfg.host_node},policy=bind,prealloc-context={PREALLOC_CONTEXT}"
    if cfg.memory_backend == "memfd":
        return f"memory-backend-memfd,{size}"
    if cfg.memory_backend == "hugepages":
        return f"memory-backend-memfd,{size},hugetlb=on,hugetlbsize=2M"
    return f"memory-backend-ram,{size}"


def memory_argv(cfg: VmConfig) -> list[str]:
    """The backend, after the thread context its pool is created from (QEMU creates that one before `-sandbox`
    forbids setting CPU affinity)."""
    ctx = (
        []
        if cfg.host_node is None
        else ["-object", f"thread-context,id={PREALLOC_CONTEXT},node-affinity={cfg.host_node}"]
    )
    return [*ctx, "-object", memory_object(cfg)]


def locked_guest(cfg: VmConfig, accel: str, numa_host: bool) -> LockedGuest:
    """What this machine locks, in the terms Cubelet's ledger charges (model/pinned_memory.py)."""
    return LockedGuest(
        memory_mib=cfg.memory_mib,
        vcpus=cfg.vcpus,
        mlock=cfg.pin_memory,
        vfio=bool(cfg.vfio_hosts),
        tcg=accel != "kvm",
        prealloc_threads=cfg.prealloc_threads,
        numa_host=numa_host or cfg.host_node is not None,
    )


def build_argv(cfg: VmConfig, accel: str, incoming: bool = False, fds: VmmFds | None = None) -> list[str]:
    """The full QEMU command line. Pure: unit tests read it, and template save/restore must produce the same one.
    `fds`: the descriptors `QemuVmm.start` made; without them, placeholders (the command line's shape only)."""
    sd = cfg.state_dir
    fds = fds or SHAPE_FDS
    shape = cfg.machine
    widest = max((p.pref64_bytes for p in shape.ports), default=DEFAULT_PREF64_WINDOW)
    cmdline = f"{cfg.cmdline} pci=hpmmioprefsize={_size(widest)}"
    if extra := cfg.guest_cmdline():
        cmdline += " " + extra
    argv = [
        qemu_binary(),
        "-name",
        find.name_arg(cfg.sandbox_id),
        "-machine",
        "q35,memory-backend=m0",
        "-global",
        f"q35-pcihost.pci-hole64-size={_size(shape.hole64_bytes)}",
        "-accel",
        "kvm" if accel == "kvm" else f"tcg,tb-size={TCG_CACHE_MIB}",
        "-smp",
        str(cfg.vcpus),
        "-m",
        f"{cfg.memory_mib}M",
        *memory_argv(cfg),
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
        # The console log is opened by the shim; `opaque` names it, and places the VMM under its state dir for
        # the /proc lookups (host/vmm/vmmproc.py `under`).
        "-add-fd",
        f"fd={fds.console},set=1,opaque={_opt(str(sd / 'console.log'))}",
        "-chardev",
        # append=on: QEMU re-applies its open flags to the shared description; the shim's cap truncates it.
        "file,id=con0,path=/dev/fdset/1,append=on",
        "-serial",
        "chardev:con0",
        "-device",
        "virtio-serial-pci,id=vser0",
        # Listening sockets created by the shim (their paths: state_dir/agent.sock, ...), passed as descriptors.
        "-chardev",
        f"socket,id=agent0,fd={fds.agent},server=on,wait=off",
        "-device",
        f"virtserialport,bus=vser0.0,chardev=agent0,name={AGENT_PORT_NAME}",
        # The workload's own port: a workload never shares a channel with validation.
        "-chardev",
        f"socket,id=workload0,fd={fds.workload},server=on,wait=off",
        "-device",
        f"virtserialport,bus=vser0.0,chardev=workload0,name={WORKLOAD_PORT_NAME}",
        "-chardev",
        f"socket,id=qmp0,fd={fds.qmp},server=on,wait=off",
        "-mon",
        "chardev=qmp0,mode=control",
        # A second monitor for Cubelet/operators while the shim holds the first.
        "-chardev",
        f"socket,id=qmp1,fd={fds.qmp_aux},server=on,wait=off",
        "-mon",
        "chardev=qmp1,mode=control",
        "-sandbox",
        SANDBOX_ARG,
    ]
    if accel == "kvm":  # the host's address width, checked against the shape before start
        argv += ["-cpu", "host,host-phys-bits=on"]
    elif shape.phys_bits != DEFAULT_PHYS_BITS:
        argv += ["-cpu", f"qemu64,phys-bits={shape.phys_bits}"]
    if cfg.pin_memory:
        argv += ["-overcommit", "mem-lock=on"]
    for i, port in enumerate(shape.ports):
        mem = f",mem-reserve={_size(port.mem32_bytes)}" if port.mem32_bytes != DEFAULT_MEM32_WINDOW else ""
        argv += [
            "-device",
            f"pcie-root-port,id=rp{i + 1},chassis={i + 1},slot={i + 1},pref64-reserve={_size(port.pref64_bytes)}{mem}",
        ]
    argv += policy_argv(cfg)
    if incoming:
        argv += ["-incoming", "defer"]
    return argv


def _size(n: int) -> str:
    """A byte count as QEMU and the kernel's memparse both read it (`2G`, `128M`, or plain bytes)."""
    for suffix, shift in (("T", 40), ("G", 30), ("M", 20), ("K", 10)):
        if n % (1 << shift) == 0:
            return f"{n >> shift}{suffix}"
    return str(n)


def _opt(value: str) -> str:
    """A QemuOpts value: commas are doubled."""
    return value.replace(",", ",,")


def _listen(path: Path) -> socket.socket:
    path.unlink(missing_ok=True)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(connect_path(path))  # owner-only: the shim's umask; the VMM never needs the file, only the descriptor
    s.listen(8)
    return s


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

    def __init__(
        self,
        cfg: VmConfig,
        restore_from: Path | None = None,
        policy: confine.ConfinePolicy | None = None,
        deadlines: StartDeadlines | None = None,
    ) -> None:
        self.cfg = cfg
        self.deadlines = deadlines or start_deadlines(cfg.memory_mib)
        self.restore_from = restore_from
        self.policy = policy or confine.ConfinePolicy.from_env()
        self.accel, self.accel_reason = detect_accel()
        self._proc: subprocess.Popen[bytes] | None = None
        self._qmp: QEMUMonitorProtocol | None = None
        self._exit: ExitInfo | None = None
        self._attached: dict[str, Attached] = {}
        self._deleted: set[str] = set()
        self.timings: dict[str, float] = {}
        self.lease: confine.UidLease | None = None
        self.memlock_mode = "none"
        self.exposure: VmmExposure | None = None

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

    def _confinement(self) -> tuple[str, confine.UidLease, VmmExposure]:
        """Decide how memory is locked, take a uid, name what the VMM may see and hand it its device nodes."""
        # VFIO pins guest RAM itself (type1), mem-lock or not: it needs the same right to lock memory.
        mode = confine.memlock_mode(self.policy, self.cfg.pin_memory or bool(self.cfg.vfio_hosts))
        if mode is None:
            raise pinned_error(
                "pinned_memory.lock_unavailable",
                f"an unprivileged VMM cannot lock guest memory here (memlock policy {self.policy.memlock}): "
                "raising its RLIMIT_MEMLOCK needs CAP_SYS_RESOURCE, granting CAP_IPC_LOCK needs it in the shim",
                policy=self.policy.memlock,
            )
        lease = confine.allocate_uid(self.policy)
        try:
            exposure = vmm_exposure(self.cfg, self.accel)
            confine.hand_over(exposure.owned, lease.uid, lease.gid)
        except BaseException:
            lease.close()
            raise
        return mode, lease, exposure

    def _check_address_bits(self) -> None:
        """Under KVM the guest has the host CPU's address width: BARs beyond it cannot be placed at all."""
        host = host_phys_bits() if self.accel == "kvm" else None
        if host is not None and self.cfg.machine.phys_bits > host:
            raise vmm_error(
                "vmm.address_space_exceeded",
                f"the devices' BARs need {self.cfg.machine.phys_bits} physical address bits; this CPU has {host}",
                needed=self.cfg.machine.phys_bits,
                host=host,
            )

    def start(self) -> None:
        sd = self.cfg.state_dir
        sd.mkdir(parents=True, exist_ok=True)
        self._check_address_bits()
        self.memlock_mode, self.lease, self.exposure = mode, lease, exposure = self._confinement()
        listeners: list[socket.socket] = []
        console = -1
        try:
            listeners = [_listen(sd / name) for name in SOCKETS]
            console = open_console(sd / CONSOLE_LOG)
            qmp, aux, agent, workload = (s.fileno() for s in listeners)
            fds = VmmFds(qmp, aux, agent, workload, console)
            argv = build_argv(self.cfg, self.accel, incoming=self.restore_from is not None, fds=fds)
            memlock = (
                None
                if mode == "none"
                else confine.memlock_limit_bytes(locked_guest(self.cfg, self.accel, len(numa_nodes()) > 1))
            )
            launch = exposure.config(
                sd / VMM_ROOT_DIR, lease.uid, lease.gid, memlock, memlock_required=mode == "rlimit"
            )
            cmd = launch_argv(json.dumps(launch), lease.uid, lease.gid, mode, argv)
            # Nothing of the shim's environment (issue 30 #6): the tags the release rules read, and PATH.
            env = childenv.vmm_env(
                {find.ENV_SANDBOX: self.cfg.sandbox_id, find.ENV_DEVICES: ";".join(self.cfg.device_ids)}
            )
            t0 = time.monotonic()
            with (sd / "vmm.log").open("ab") as log:
                # Own session: the VMM must outlive a killed shim so Cubelet can find it by pid + tag. It inherits
                # the uid lease, which is then held exactly as long as it runs.
                self._proc = subprocess.Popen(
                    cmd,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                    env=env,
                    start_new_session=True,
                    cwd="/",
                    pass_fds=(*fds.all(), lease.fd, *self.cfg.inherited_fds),
                )
        except BaseException:
            if self._proc is None:  # nothing runs as the uid: give it and the nodes back now
                self._release_confinement()
            raise
        finally:  # the VMM holds its own copies; ours closed, a dead VMM's sockets refuse their clients
            for s in listeners:
                s.close()
            if console >= 0:
                os.close(console)
        (sd / "vmm.pid").write_text(f"{self._proc.pid}\n")
        self._connect(t0)
        self.timings["spawn_to_qmp_s"] = time.monotonic() - t0
        if self.restore_from is not None:
            t1 = time.monotonic()
            self._restore(self.restore_from)
            self.timings["restore_s"] = time.monotonic() - t1

    def verify_confined(self) -> dict[str, Any]:
        """Read the running VMM's uid, capabilities, seccomp mode and mount namespace from /proc, or refuse."""
        if self.lease is None:
            raise vmm_error("vmm.not_started", "VMM not started")
        uid = self.lease.uid + (1 if self.policy.fault == "wrong_uid" else 0)
        want = confine.Expected(uid, self.lease.gid, confine.expected_caps(self.memlock_mode), _own_mnt_ns())
        proof = confine.verify_pid(self.pid, want)
        exposure = self.exposure or VmmExposure()
        return {
            **proof,
            "memlock_mode": self.memlock_mode,
            "exposed": [
                *exposure.trees_ro,
                *exposure.read_only,
                *exposure.read_write,
                *exposure.devices,
                *exposure.private_nodes,
            ],
            "handed_over": [str(p) for p in exposure.owned],
        }

    def _log_tail(self) -> str:
        try:
            return (self.cfg.state_dir / "vmm.log").read_text(errors="replace")[-1000:]
        except OSError:
            return ""

    def _early_exit(self) -> CubeError:
        info = self.poll_exit()
        tail = self._log_tail()
        exit_json = info.to_json() if info else None
        confine_line = next((ln for ln in reversed(tail.splitlines()) if ln.startswith('{"confine_error"')), None)
        if confine_line is not None or "setpriv:" in tail:
            try:
                step = json.loads(confine_line or "{}")
            except ValueError:
                step = {}
            return vmm_error(
                "vmm.confinement_failed",
                f"the VMM could not be confined, so it was not run: {tail.strip()[-300:]}",
                step=step,
                exit=exit_json,
            )
        if "mlock" in tail or "locking memory" in tail:
            return pinned_error(
                "pinned_memory.lock_failed",
                f"VMM could not lock guest memory: {tail.strip()[-300:]}",
                exit=exit_json,
            )
        return vmm_error("vmm.start_failed", f"QEMU exited during start: {tail.strip()[-500:]}", exit=exit_json)

    def _exited_or(self, other: CubeError, wait_s: float = 2.0) -> CubeError:
        """A broken QMP socket at start is most often a VMM that exited: say why it did, when it did."""
        end = time.monotonic() + wait_s
        while self.poll_exit() is None and time.monotonic() < end:
            time.sleep(0.02)
        return self._early_exit() if self.poll_exit() is not None else other

    def _connect(self, t0: float) -> None:
        """The socket listens from the start (the shim made it): connect, then wait for QEMU's greeting."""
        wait_s = self.deadlines.vmm_ready_s  # every page is touched before QEMU answers: seconds per GiB when cold
        deadline = t0 + wait_s
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            try:
                sock.connect(connect_path(self.cfg.state_dir / "qmp.sock"))
            except OSError as e:  # refused: the VMM already exited, and closed the last copy of the listener
                raise self._exited_or(vmm_error("vmm.qmp_failed", f"QMP socket: {e}")) from e
            while not select.select([sock], [], [], 0.05)[0]:
                if self.poll_exit() is not None:
                    raise self._early_exit()
                if time.monotonic() > deadline:
                    raise vmm_error(
                        "vmm.qmp_timeout",
                        f"QMP socket did not answer within {wait_s:.0f} s ({self.cfg.memory_mib} MiB preallocated)",
                        memory_mib=self.cfg.memory_mib,
                        timeout_s=wait_s,
                    )
        except BaseException:
            sock.close()
            raise
        qmp = QEMUMonitorProtocol(sock)
        try:
            qmp.connect()
        except (QMPError, OSError) as e:
            with contextlib.suppress(QMPError, OSError, RuntimeError, EOFError):
                qmp.close()
            raise self._exited_or(vmm_error("vmm.qmp_failed", f"QMP greeting: {type(e).__name__}: {e}")) from e
        qmp.settimeout(QMP_TIMEOUT_S)
        self._qmp = qmp

    def qmp(self, command: str, **args: Any) -> Any:
        if self._qmp is None:
            raise vmm_error("vmm.not_started", "QMP not connected")
        try:
            return self._qmp.cmd(command, **args)
        except ExecuteError as e:
            raise vmm_error("vmm.qmp_error", f"{command}: {e.error.error.desc}", qmp_class=e.error_class) from e
        except (QMPError, OSError, TimeoutError, EOFError, RuntimeError) as e:
            raise vmm_error("vmm.qmp_failed", f"{command}: {type(e).__name__}: {e}") from e

    def _send_fd(self, path: Path, flags: int) -> None:
        """Open `path` here and hand the descriptor to QEMU as `MIGRATION_FD` (the VMM opens no files)."""
        if self._qmp is None:
            raise vmm_error("vmm.not_started", "QMP not connected")
        fd = os.open(path, flags | os.O_CLOEXEC, 0o600)
        try:
            self._qmp.send_fd_scm(fd)
            self.qmp("getfd", fdname=MIGRATION_FD)
        except (QMPError, OSError) as e:
            raise vmm_error("vmm.qmp_failed", f"passing {path.name} to QEMU: {e}") from e
        finally:
            os.close(fd)

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
        self._send_fd(state, os.O_RDONLY)
        self.qmp("migrate-incoming", uri=f"fd:{MIGRATION_FD}")
        self._wait_status({"paused", "postmigrate"}, self.deadlines.migrate_s)
        mig = self.qmp("query-migrate")
        if mig.get("status") not in (None, "completed"):
            raise vmm_error("vmm.restore_failed", f"restore from {state}: migration {mig.get('status')}")
        self.qmp("cont")

    def save_state(self, dest: Path, timeout_s: float | None = None) -> None:
        """Pause and write the VM's state to `dest`. Refused while any device is attached, by our own record or
        by QEMU's answer before and after the migration (the state file is then never put in place)."""
        if self._attached:
            raise CubeError(
                "lifecycle.snapshot_with_device",
                "a VM with a device attached is never snapshotted",
                layer="backend",
                details={"devices": sorted(self._attached)},
            )
        tmp = dest.with_suffix(".partial")
        self.qmp("stop")
        self.refuse_foreign_devices()
        try:
            self._send_fd(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            self.qmp("migrate", uri=f"fd:{MIGRATION_FD}")
            deadline = time.monotonic() + (self.deadlines.migrate_s if timeout_s is None else timeout_s)
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

    def add_memory(self, obj_id: str, path: str, size: int) -> None:
        """A shared file-backed memory object for a device's `memdev` (the ivshmem-plain stand-in): what the guest
        writes into the device lands in the file, which outlives this VMM."""
        self.qmp(
            "object-add",
            **{"qom-type": "memory-backend-file", "id": obj_id, "mem-path": path, "size": size, "share": True},
        )

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
        if self._exit.how != "unreaped":
            self._release_confinement()
        return self._exit

    def _release_confinement(self) -> None:
        """After a confirmed exit: our copy of the uid lease, and the device nodes back to root (best effort;
        the release rules check the nodes again before the device leaves `releasing`)."""
        if self.lease is not None:
            self.lease.close()
        for node in self.exposure.owned if self.exposure else ():
            confine.take_back(node)

    def close(self) -> None:
        if self._qmp is not None:
            with contextlib.suppress(QMPError, OSError, RuntimeError, EOFError):
                self._qmp.close()
            self._qmp = None


def _own_mnt_ns() -> str | None:
    try:
        return os.readlink("/proc/self/ns/mnt")
    except OSError:
        return None


def _conforms(vmm: QemuVmm) -> Vmm:
    """mypy --strict checks here that QemuVmm implements the Vmm protocol."""
    return vmm
