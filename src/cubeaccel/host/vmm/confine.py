"""The confined VMM's host side: its uid, its locked-memory limit, and the proof read back from /proc.

Each QEMU runs as its own uid from a configured range (`CUBEACCEL_VMM_UIDS`, default 1900000000-1900004095), with
its own gid and no supplementary groups, so two sandboxes never share credentials: neither can signal, ptrace or
open what the other owns. A uid is taken by an exclusive flock on `<lock dir>/<uid>.lock` that the VMM itself
inherits, so it is free exactly when the VMM and its shim are gone (and, against a VMM that unlocks it, only while
no live process runs as that uid).

Locked memory: an unprivileged VMM needs RLIMIT_MEMLOCK raised for it, which takes CAP_SYS_RESOURCE in the parent.
A host whose root lacks that capability (these machines: docs/security.md) can only keep CAP_IPC_LOCK for the VMM;
`memlock_mode` says which, and the verification expects exactly that capability set.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cubeaccel.model.pinned_memory import LockedGuest, vmm_locked
from cubeaccel.protocol.errors import CubeError

CAP_IPC_LOCK = 14
CAP_SYS_RESOURCE = 24
DEFAULT_UIDS = (1_900_000_000, 4096)
DEFAULT_LOCK_DIR = Path("/run/cubeaccel/vmm-uids")
ENV_UIDS = "CUBEACCEL_VMM_UIDS"  # START-END, inclusive
ENV_LOCK_DIR = "CUBEACCEL_VMM_UID_LOCKS"
ENV_MEMLOCK = "CUBEACCEL_VMM_MEMLOCK"  # auto | rlimit | cap_ipc_lock
# Test fault: verification expects another uid than the VMM got, so a start is refused on a real /proc reading.
# It can only make a start fail, never let an unconfined VMM pass.
ENV_FAULT = "CUBEACCEL_VMM_CONFINE_FAULT"


def confine_error(code: str, message: str, **details: Any) -> CubeError:
    return CubeError(code=code, message=message, layer="backend", details=dict(details), status=500)


@dataclass(frozen=True)
class ConfinePolicy:
    uid_start: int = DEFAULT_UIDS[0]
    uid_count: int = DEFAULT_UIDS[1]
    lock_dir: Path = DEFAULT_LOCK_DIR
    memlock: str = "auto"  # auto | rlimit | cap_ipc_lock
    fault: str | None = None

    @property
    def uids(self) -> range:
        return range(self.uid_start, self.uid_start + self.uid_count)

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> ConfinePolicy:
        e = os.environ if env is None else env
        start, count = DEFAULT_UIDS
        if raw := e.get(ENV_UIDS):
            lo, sep, hi = raw.partition("-")
            if not (sep and lo.isdigit() and hi.isdigit() and 0 < int(lo) <= int(hi) < 2**32 - 1):
                raise confine_error("vmm.confine_config", f"{ENV_UIDS}={raw!r}: want START-END, 0 < START <= END")
            start, count = int(lo), int(hi) - int(lo) + 1
        memlock = e.get(ENV_MEMLOCK, "auto")
        if memlock not in ("auto", "rlimit", "cap_ipc_lock"):
            raise confine_error("vmm.confine_config", f"{ENV_MEMLOCK}={memlock!r}: want auto, rlimit or cap_ipc_lock")
        return cls(start, count, Path(e.get(ENV_LOCK_DIR, str(DEFAULT_LOCK_DIR))), memlock, e.get(ENV_FAULT) or None)


@dataclass
class UidLease:
    """One uid (and the gid of the same number) held for one VMM; `fd` goes to the VMM so the lease lives as
    long as it does."""

    uid: int
    fd: int
    path: Path

    @property
    def gid(self) -> int:
        return self.uid

    def close(self) -> None:
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1


def _uids_in_use(proc_root: Path) -> set[int]:
    used: set[int] = set()
    for entry in proc_root.iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            for line in (entry / "status").read_text().splitlines():
                if line.startswith("Uid:"):
                    used.update(int(x) for x in line.split()[1:])
                    break
    return used


def allocate_uid(policy: ConfinePolicy, proc_root: Path = Path("/proc")) -> UidLease:
    """The first uid of the range that no VMM holds and no process runs as. Refused when the range is full."""
    policy.lock_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    used = _uids_in_use(proc_root)
    for uid in range(policy.uid_start, policy.uid_start + policy.uid_count):
        if uid in used:
            continue
        path = policy.lock_dir / f"{uid}.lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        if uid in _uids_in_use(proc_root):  # a process took it between the scan and the lock
            os.close(fd)
            continue
        return UidLease(uid, fd, path)
    raise confine_error(
        "vmm.no_uid",
        f"every VMM uid in {policy.uid_start}-{policy.uid_start + policy.uid_count - 1} is in use",
        range=[policy.uid_start, policy.uid_start + policy.uid_count - 1],
    )


def own_caps(proc_root: Path = Path("/proc")) -> dict[str, int]:
    """This process's capability sets (CapEff, CapPrm, CapBnd, ...) as integers."""
    out: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for line in (proc_root / "self" / "status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.startswith("Cap"):
                out[key] = int(value.strip(), 16)
    return out


def memlock_mode(policy: ConfinePolicy, pin_memory: bool, caps: dict[str, int] | None = None) -> str | None:
    """`none` (nothing to lock), `rlimit` (the VMM's RLIMIT_MEMLOCK is raised for it; no capabilities) or
    `cap_ipc_lock` (the host cannot raise it: the VMM keeps exactly CAP_IPC_LOCK); None when neither works."""
    if not pin_memory:
        return "none"
    c = own_caps() if caps is None else caps
    can_raise = bool(c.get("CapEff", 0) >> CAP_SYS_RESOURCE & 1)
    can_grant = bool(c.get("CapEff", 0) >> CAP_IPC_LOCK & 1) and bool(c.get("CapBnd", 0) >> CAP_IPC_LOCK & 1)
    if policy.memlock in ("auto", "rlimit") and can_raise:
        return "rlimit"
    if policy.memlock in ("auto", "cap_ipc_lock") and can_grant:
        return "cap_ipc_lock"
    return None


def memlock_limit_bytes(guest: LockedGuest) -> int:
    """The VMM's RLIMIT_MEMLOCK: what the ledger's `rlimit_mib` says (model/pinned_memory.py), so a sandbox the
    ledger admitted is never one whose VMM then fails to lock."""
    return vmm_locked(guest).rlimit_mib * 1024 * 1024


def expected_caps(mode: str) -> int:
    return 1 << CAP_IPC_LOCK if mode == "cap_ipc_lock" else 0


@dataclass(frozen=True)
class VmmCredentials:
    """What /proc says about a running VMM."""

    uids: tuple[int, ...]
    gids: tuple[int, ...]
    groups: tuple[int, ...]
    caps: dict[str, int]
    no_new_privs: int | None
    seccomp: int | None
    mnt_ns: str | None
    memlock_limit: str | None
    mounts: tuple[str, ...] = field(default=())

    def to_json(self) -> dict[str, object]:
        return {
            "uid": self.uids[0] if self.uids else None,
            "gid": self.gids[0] if self.gids else None,
            "groups": list(self.groups),
            **{k.lower(): f"{v:016x}" for k, v in sorted(self.caps.items())},
            "no_new_privs": self.no_new_privs,
            "seccomp": self.seccomp,
            "mnt_ns": self.mnt_ns,
            "memlock_limit": self.memlock_limit,
            "mounts": list(self.mounts),
        }


def read_credentials(pid: int, proc_root: Path = Path("/proc")) -> VmmCredentials:
    p = proc_root / str(pid)
    try:
        status = (p / "status").read_text()
    except OSError as e:
        raise confine_error("vmm.not_confined", f"VMM {pid}: cannot read /proc status: {e}", pid=pid) from e
    fields: dict[str, str] = {}
    for line in status.splitlines():
        key, _, value = line.partition(":")
        fields[key] = value.strip()

    def ints(key: str) -> tuple[int, ...]:
        return tuple(int(x) for x in fields.get(key, "").split() if x.isdigit())

    def num(key: str) -> int | None:
        v = fields.get(key, "")
        return int(v) if v.isdigit() else None

    caps = {k: int(v, 16) for k, v in fields.items() if k.startswith("Cap")}
    ns: str | None
    try:
        ns = os.readlink(p / "ns" / "mnt")
    except OSError:
        ns = None
    limit = None
    with contextlib.suppress(OSError):
        for line in (p / "limits").read_text().splitlines():
            if line.startswith("Max locked memory"):
                limit = line.split()[3]  # soft limit, bytes or "unlimited"
    mounts: tuple[str, ...] = ()
    with contextlib.suppress(OSError):
        mounts = tuple(line.split()[4] for line in (p / "mountinfo").read_text().splitlines() if len(line.split()) > 4)
    return VmmCredentials(
        ints("Uid"), ints("Gid"), ints("Groups"), caps, num("NoNewPrivs"), num("Seccomp"), ns, limit, mounts
    )


@dataclass(frozen=True)
class Expected:
    uid: int
    gid: int
    caps: int  # CapEff, CapPrm and CapBnd must equal this mask
    host_mnt_ns: str | None  # the shim's own mount namespace: the VMM's must differ


def verify(creds: VmmCredentials, want: Expected) -> list[str]:
    """Every way the VMM is not what was launched; empty when confined."""
    bad = []
    if not creds.uids or set(creds.uids) != {want.uid}:
        bad.append(f"uid {list(creds.uids)} (want {want.uid})")
    if not creds.gids or set(creds.gids) != {want.gid}:
        bad.append(f"gid {list(creds.gids)} (want {want.gid})")
    if creds.groups:
        bad.append(f"supplementary groups {list(creds.groups)}")
    for key in ("CapEff", "CapPrm", "CapBnd"):
        if creds.caps.get(key) != want.caps:
            bad.append(f"{key} {creds.caps.get(key, -1):x} (want {want.caps:x})")
    if creds.caps.get("CapAmb", 0) & ~want.caps or creds.caps.get("CapInh", 0) & ~want.caps:
        bad.append("inheritable/ambient capabilities beyond the allowed set")
    if creds.no_new_privs != 1:
        bad.append(f"NoNewPrivs {creds.no_new_privs}")
    if creds.seccomp != 2:
        bad.append(f"Seccomp {creds.seccomp} (want 2: filter)")
    if creds.mnt_ns is None or creds.mnt_ns == want.host_mnt_ns:
        bad.append(f"mount namespace {creds.mnt_ns} is the host's")
    return bad


def verify_pid(pid: int, want: Expected, proc_root: Path = Path("/proc")) -> dict[str, Any]:
    """The VMM's confinement read from /proc, or `vmm.not_confined` listing what is wrong."""
    creds = read_credentials(pid, proc_root)
    bad = verify(creds, want)
    if bad:
        raise confine_error(
            "vmm.not_confined", f"VMM {pid} is not confined: {'; '.join(bad)}", pid=pid, problems=bad, **creds.to_json()
        )
    return {"pid": pid, **creds.to_json()}


def hand_over(nodes: tuple[Path, ...], uid: int, gid: int) -> None:
    """Give the VMM's uid the device nodes it must open (VFIO group nodes), owner-only."""
    for node in nodes:
        if os.path.islink(node):
            raise confine_error("vmm.device_node_refused", f"{node} is a symlink", node=str(node))
        os.chown(node, uid, gid)
        os.chmod(node, 0o600)


def take_back(node: Path) -> str | None:
    """Return a node to root, owner-only; None when it is (or already was), else why not."""
    try:
        st = os.lstat(node)
    except FileNotFoundError:
        return None  # gone with its group: nothing is handed to anyone
    except OSError as e:
        return f"{node}: {e}"
    if os.path.islink(node):
        return f"{node} is a symlink"
    try:
        if (st.st_uid, st.st_gid) != (0, 0):
            os.chown(node, 0, 0)
        if st.st_mode & 0o077:
            os.chmod(node, st.st_mode & 0o700)
        after = os.lstat(node)
    except OSError as e:
        return f"{node}: {e}"
    if (after.st_uid, after.st_gid) != (0, 0) or after.st_mode & 0o077:
        return f"{node} is still owned by {after.st_uid}:{after.st_gid} mode {after.st_mode & 0o777:o}"
    return None


def cubelet_verdict(pid: int, claimed_uid: object, proc_root: Path = Path("/proc")) -> list[str]:
    """Cubelet's own reading of a VMM its shim says is confined, before any device reaches it: the uid the shim
    claimed (never root), at most CAP_IPC_LOCK in every capability set, seccomp filtering, no_new_privs, and a
    mount namespace other than Cubelet's. Empty when confined; the shim's word alone is not enough."""
    try:
        creds = read_credentials(pid, proc_root)
    except CubeError as e:
        return [e.message]
    bad = []
    if not isinstance(claimed_uid, int) or isinstance(claimed_uid, bool) or claimed_uid <= 0:
        bad.append(f"claimed uid {claimed_uid!r} (want an unprivileged uid)")
    elif not creds.uids or set(creds.uids) != {claimed_uid}:
        bad.append(f"uid {list(creds.uids)} (shim claimed {claimed_uid})")
    allowed = 1 << CAP_IPC_LOCK
    for name in ("CapEff", "CapPrm", "CapBnd"):
        if creds.caps.get(name, -1) & ~allowed:
            bad.append(f"{name} {creds.caps.get(name, -1):016x} (at most {allowed:016x})")
    if creds.seccomp != 2:
        bad.append(f"seccomp mode {creds.seccomp} (want 2, filtering)")
    if creds.no_new_privs != 1:
        bad.append(f"no_new_privs {creds.no_new_privs} (want 1)")
    try:
        own = os.readlink(proc_root / "self" / "ns" / "mnt")
    except OSError:
        own = None
    if creds.mnt_ns is None or creds.mnt_ns == own:
        bad.append(f"mount namespace {creds.mnt_ns} (want its own, not Cubelet's)")
    return bad
