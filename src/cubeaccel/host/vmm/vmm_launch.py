"""The VMM's launcher: run as root between fork and QEMU, it builds the VMM's own filesystem and sets its limits.

`python -S vmm_launch.py CONFIG_JSON -- setpriv ... qemu-system-x86_64 ...` (stdlib only: it runs by path, before
any import of cubeaccel could be trusted to resolve). In a new mount namespace it mounts a tmpfs root holding only
`/usr` (QEMU, its libraries and firmware, read-only), the named files bind-mounted at their own paths (kernel and
initrd read-only, device nodes), pivots into it and detaches the host's tree, so nothing else of the host exists
for the VMM. It then sets RLIMIT_MEMLOCK and RLIMIT_CORE (a core file would be guest memory) and execs the rest:
`setpriv` drops uid, gid, groups and capabilities, and QEMU installs its seccomp filter (`-sandbox`). Sockets,
console and logs arrive as inherited descriptors, so the VMM has no writable file at all.

Any failure prints one JSON line `{"confine_error": STEP, ...}` on stderr and exits 121: a VMM never runs
half-confined.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import shutil
import stat
import sys
from typing import Any, NoReturn

EXIT_CONFINE = 121
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
CLONE_NEWNS = 0x00020000
MNT_DETACH = 2
SYS_PIVOT_ROOT = 155  # x86_64
_libc = ctypes.CDLL(None, use_errno=True)


def fail(step: str, **details: Any) -> NoReturn:
    print(json.dumps({"confine_error": step, **details}), file=sys.stderr, flush=True)
    sys.exit(EXIT_CONFINE)


def _check(rc: int, step: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        fail(step, errno=err, message=os.strerror(err))


def mount(src: str | None, dst: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    rc = _libc.mount(
        src.encode() if src else None,
        dst.encode(),
        fstype.encode() if fstype else None,
        ctypes.c_ulong(flags),
        data.encode() if data else None,
    )
    _check(rc, f"mount {src} on {dst}")


def bind(root: str, src: str, flags: int, tree: bool = False) -> None:
    """Bind `src` at the same path under `root`, then remount the bind with `flags` (read-only, nosuid...)."""
    dst = root + os.path.abspath(src)
    if not os.path.exists(src):
        fail("missing", path=src)
    if tree:
        os.makedirs(dst, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        with open(dst, "a"):
            pass
    mount(src, dst, None, MS_BIND | (MS_REC if tree else 0))
    mount(None, dst, None, MS_REMOUNT | MS_BIND | flags)


def build_root(cfg: dict[str, Any]) -> None:
    root = cfg["root"]
    os.umask(0o022)  # the shim's is 077: the VMM's uid must traverse the directories made here (read-only tmpfs)
    _check(_libc.unshare(CLONE_NEWNS), "unshare mount namespace")
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing mounted here reaches the host, nor back
    os.makedirs(root, mode=0o700, exist_ok=True)  # the mount point, on the host: owner-only like the state dir
    mount("cubeaccel-vmm", root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m")
    os.mkdir(root + "/dev")  # its own tmpfs: the one place device nodes work (read-only once built)
    mount("cubeaccel-vmm-dev", root + "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=0755,size=64k")
    for tree in cfg.get("trees_ro", []):
        bind(root, tree, MS_RDONLY | MS_NOSUID | MS_NODEV, tree=True)
    for link in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):  # merged /usr: the loader's paths
        if os.path.islink(link):
            os.symlink(os.readlink(link), root + link)
    for path in cfg.get("read_only", []):
        bind(root, path, MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)
    for path in cfg.get("read_write", []):
        bind(root, path, MS_NOSUID | MS_NODEV | MS_NOEXEC)
    for node in cfg.get("devices", []):
        bind(root, node, MS_NOSUID | MS_NOEXEC)
    for path, uid, gid in cfg.get("private_nodes", []):
        private_node(root, path, uid, gid)
    old = root + "/.host"
    os.mkdir(old)
    _check(_libc.syscall(SYS_PIVOT_ROOT, root.encode(), old.encode()), "pivot_root")
    os.chdir("/")
    _check(_libc.umount2(b"/.host", MNT_DETACH), "detach the host's tree")
    os.rmdir("/.host")
    mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    mount(None, "/dev", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NOEXEC)


def private_node(root: str, path: str, uid: int, gid: int) -> None:
    """A node of the same device as `path`, owned by the VMM's uid, in the VMM's /dev only: for nodes many VMMs
    share (/dev/kvm is root:kvm 0660 on the host), so no host node's ownership or group changes."""
    if not path.startswith("/dev/"):
        fail("private node outside /dev", path=path)
    try:
        st = os.stat(path)
    except OSError as e:
        fail("missing", path=path, message=str(e))
    if not stat.S_ISCHR(st.st_mode):
        fail("not a character device", path=path)
    dst = root + path
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    os.mknod(dst, stat.S_IFCHR | 0o600, st.st_rdev)
    os.chown(dst, uid, gid)


def set_limits(cfg: dict[str, Any]) -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    want = cfg.get("memlock")
    if want is None:
        return
    try:
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (want, want))
    except (OSError, ValueError) as e:
        if cfg.get("memlock_required"):
            fail("RLIMIT_MEMLOCK", want=want, message=str(e))
        # With CAP_IPC_LOCK the limit does not bind; lower it as far as allowed (never above what was asked)
        _soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        low = want if hard == resource.RLIM_INFINITY else min(want, hard)
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (low, low))


def main(argv: list[str]) -> NoReturn:
    if len(argv) < 4 or argv[2] != "--":
        fail("usage", argv=argv[:3])
    cfg = json.loads(argv[1])
    cmd = argv[3:]
    exe = shutil.which(cmd[0])  # resolved in the host's tree: after the pivot only /usr is left
    if exe is None:
        fail("missing", path=cmd[0])
    build_root(cfg)
    set_limits(cfg)
    try:
        os.execv(exe, cmd)
    except OSError as e:
        fail("exec", path=exe, errno=e.errno, message=e.strerror)


if __name__ == "__main__":
    main(sys.argv)
