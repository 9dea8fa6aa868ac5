"""Finding a sandbox's VMM from /proc, by pid and the tag on its command line — for when the shim is gone.

The shim starts the VMM in its own session so that a dead shim leaves it running; Cubelet then finds it here
(`find_vmm`) and applies the release rules. Backends use `vmm_processes` to name the holders of a device: the
VMM's environment carries the Cubelet device ids it may hold.

A host may run several Cubelets (two test runs, a demo beside a node), and sandbox ids are theirs to choose, so
a Cubelet looks only at processes under its own state directory (`under`): its shims' `--spec` and its VMMs'
sockets live there. A tag alone never makes another Cubelet's VMM ours — to wait for, or to kill.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from cubeaccel.model.ids import SANDBOX_ID_PATTERN

TAG_PREFIX = "cubeaccel-sandbox="
# The tag inside one argv element: QEMU's `-name guest=cubeaccel-sandbox=ID`.
_TAG = re.compile(r"(?:^|[=,])" + re.escape(TAG_PREFIX) + f"({SANDBOX_ID_PATTERN})")
ENV_SANDBOX = "CUBEACCEL_SANDBOX"
ENV_DEVICES = "CUBEACCEL_DEVICES"


def name_arg(sandbox_id: str) -> str:
    """QEMU `-name` value carrying the tag (`guest=` keeps QEMU from parsing the tag as an option)."""
    return f"guest={TAG_PREFIX}{sandbox_id}"


@dataclass(frozen=True)
class VmmProcess:
    pid: int
    sandbox_id: str
    device_ids: tuple[str, ...]
    command: str
    argv: tuple[str, ...] = ()
    uid: int | None = None  # real uid from /proc/<pid>/status; None when unreadable

    def under(self, root: Path) -> bool:
        """Whether this VMM's own files (QMP/API sockets, console) lie under `root`."""
        return _mentions(self.argv, root)


def _mentions(argv: tuple[str, ...] | list[str], root: Path) -> bool:
    prefix = f"{root}/"
    return any(prefix in a for a in argv)


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


def _state(proc: Path) -> str | None:
    raw = _read(proc / "stat")
    if raw is None:
        return None
    return raw.rsplit(b")", 1)[-1].split()[0].decode()


def inspect(pid: int, proc_root: Path = Path("/proc")) -> VmmProcess | None:
    """The tagged VMM with this pid, or None (not a VMM of ours, gone, or a zombie)."""
    proc = proc_root / str(pid)
    cmdline = _read(proc / "cmdline")
    if not cmdline or _state(proc) in (None, "Z", "X"):
        return None
    argv = [a.decode(errors="replace") for a in cmdline.split(b"\0") if a]
    sandbox = None
    for arg in argv:
        if m := _TAG.search(arg):
            sandbox = m.group(1)
    if sandbox is None:
        return None
    devices: tuple[str, ...] = ()
    env = _read(proc / "environ") or b""
    for item in env.split(b"\0"):
        if item.startswith(ENV_DEVICES.encode() + b"="):
            devices = tuple(d for d in item.split(b"=", 1)[1].decode().split(";") if d)
    return VmmProcess(pid, sandbox, devices, argv[0] if argv else "", tuple(argv), _uid(proc))


def _uid(proc: Path) -> int | None:
    for line in (_read(proc / "status") or b"").splitlines():
        if line.startswith(b"Uid:"):
            fields = line.split()
            return int(fields[1]) if len(fields) > 1 and fields[1].isdigit() else None
    return None


def vmm_processes(proc_root: Path = Path("/proc")) -> list[VmmProcess]:
    out = []
    for entry in proc_root.iterdir():
        if entry.name.isdigit() and (p := inspect(int(entry.name), proc_root)) is not None:
            out.append(p)
    return sorted(out, key=lambda p: p.pid)


def find_vmm(sandbox_id: str, proc_root: Path = Path("/proc"), under: Path | None = None) -> int | None:
    """Pid of the live VMM tagged with `sandbox_id` (and with its files `under` that directory, when given),
    or None. Zombies do not count: they hold nothing."""
    for p in vmm_processes(proc_root):
        if p.sandbox_id == sandbox_id and (under is None or p.under(under)):
            return p.pid
    return None


def _argv(pid: int, proc_root: Path) -> list[str] | None:
    proc = proc_root / str(pid)
    cmdline = _read(proc / "cmdline")
    if not cmdline or _state(proc) in (None, "Z", "X"):
        return None
    return [a.decode(errors="replace") for a in cmdline.split(b"\0") if a]


def find_shim(sandbox_id: str, proc_root: Path = Path("/proc"), under: Path | None = None) -> int | None:
    """Pid of the live shim serving `sandbox_id`: argv holds `shim run` and exactly `--sandbox <id>` (and, when
    `under` is given, a `--spec` under that directory).

    Found from /proc, not from a pid file, so a Cubelet that crashed between spawning a shim and
    recording it still finds it (and `--sandbox a` never matches `--sandbox ab`).
    """
    try:
        entries = [e.name for e in proc_root.iterdir() if e.name.isdigit()]
    except OSError:
        return None
    for name in entries:
        argv = _argv(int(name), proc_root)
        if not argv or "run" not in argv or not any(a in ("shim", "cubeaccel.shim") for a in argv):
            continue
        if under is not None and not any(
            a == "--spec" and _mentions(argv[i + 1 : i + 2], under) for i, a in enumerate(argv)
        ):
            continue
        for i, arg in enumerate(argv[:-1]):
            if arg == "--sandbox" and argv[i + 1] == sandbox_id:
                return int(name)
    return None
