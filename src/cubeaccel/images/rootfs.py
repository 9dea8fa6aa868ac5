"""The guest root filesystem: busybox + bash/coreutils + a pruned python3.11 + cube-agent + cube-workload.

Built from extracted Debian packages (no debootstrap): busybox-static provides the shell and `modprobe`; python
comes from python3.11-minimal and libpython3.11-stdlib plus the shared libraries their core modules need. Bytecode
is compiled once here with the guest's own interpreter (unchecked-hash pycs), because compiling the stdlib on every
boot under TCG costs seconds. cube-agent and cube-workload (`src/cubeaccel/{agent,workload,guest,protocol,model}`)
live in /opt/cubeaccel. bash and coreutils are there because the E2B SDK runs every command as `/bin/bash -l -c CMD`;
`/etc/passwd` names `root` and `user` (envd's default user), each with a home.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from cubeaccel.images import packages
from cubeaccel.images.packages import image_error
from cubeaccel.protocol.agent_protocol import AGENT_PORT_NAME
from cubeaccel.protocol.mux import WORKLOAD_PORT_NAME

ROOTFS_PACKAGES = (
    "busybox-static",
    "python3.11-minimal",
    "libpython3.11-minimal",
    "libpython3.11-stdlib",
    "libc6",
    "zlib1g",
    "libexpat1",
    "libffi8",
    "libssl3",
    "liblzma5",
    "libbz2-1.0",
    # the workload's shell and tools (bash -l -c CMD), and their libraries
    "bash",
    "libtinfo6",
    "coreutils",
    "libacl1",
    "libattr1",
    "libgmp10",
    "libselinux1",
    "libpcre2-8-0",
    # mke2fs for the home's RAM disk (images/rootfs.py INIT_SCRIPT); e2fsprogs whole, as on Debian (and E2B's base)
    "e2fsprogs",
    "libext2fs2",
    "libss2",
    "logsave",
    "libblkid1",
    "libuuid1",
    "libcom-err2",
)
AGENT_HOME = "/opt/cubeaccel"

# Large or useless-in-a-guest parts of the packages. Extension modules whose libraries are not in the image go too,
# so `import` fails cleanly instead of at dlopen time.
_PRUNE_DIRS = (
    "usr/share",
    "usr/lib/python3.11/test",
    "usr/lib/python3.11/idlelib",
    "usr/lib/python3.11/tkinter",
    "usr/lib/python3.11/turtledemo",
    "usr/lib/python3.11/ensurepip",
    "usr/lib/python3.11/lib2to3",
    "usr/lib/python3.11/pydoc_data",
    "usr/lib/python3.11/distutils",
    "usr/lib/python3.11/sqlite3",
    "usr/lib/python3.11/curses",
    "usr/lib/x86_64-linux-gnu/gconv",
    "usr/lib/x86_64-linux-gnu/audit",
    "usr/lib/x86_64-linux-gnu/engines-3",
    "usr/lib/x86_64-linux-gnu/ossl-modules",
    "usr/libexec",
    "usr/bin/openssl",
    "etc",
    "var",
)
_PRUNE_DYNLOAD_PREFIXES = (
    "_test",
    "_xx",
    "xxlimited",
    "_curses",
    "readline",
    "nis",
    "_dbm",
    "_sqlite3",
    "_crypt",
    "audioop",
    "ossaudiodev",
    "_ctypes_test",
)
_APPLETS = (
    "sh",
    "mount",
    "umount",
    "mkdir",
    "cat",
    "ls",
    "modprobe",
    "insmod",
    "lsmod",
    "poweroff",
    "sleep",
    "usleep",
    "echo",
    "uname",
    "dmesg",
    "ps",
    "kill",
    "sync",
    "ip",
)

WORKLOAD_USER = "user"
# /tmp and the home, together, may take this share of the memory available once the root is unpacked; the rest is
# the services' and the commands' (docs/decisions.md).
DISK_SHARE_PCT = 50
PASSWD = "root:x:0:0:root:/root:/bin/bash\nuser:x:1000:1000:user:/home/user:/bin/bash\n"
GROUP = "root:x:0:\nuser:x:1000:\n"

INIT_SCRIPT = f"""#!/bin/sh
# cubeaccel guest init: mount the basics, load the virtio modules from modules.img, run cube-workload and
# cube-agent, each on its own virtio-serial port.
export PATH=/bin:/usr/bin:/sbin:/usr/sbin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mkdir -p /tmp /run /dev/pts
mount -t devpts devpts /dev/pts
# The guest's own services (this init, cube-agent, cube-workload) are out of the OOM killer's reach; the workload
# raises each command's own (workload/limits.py), so an OOM can only pick a command.
echo -1000 > /proc/self/oom_score_adj
# A name /etc/hosts resolves (sudo warns on stderr, every time, when it cannot resolve the host's name).
echo sandbox > /proc/sys/kernel/hostname
# /tmp and the user's home share one RAM disk: ext4 (no journal, user xattrs for E2B's file metadata, which the
# RAM-backed root, Linux 6.1's tmpfs, refuses) of {DISK_SHARE_PCT}% of the memory available once the root is
# unpacked, so together they are bounded below the guest's memory: a command that fills both gets ENOSPC, and the
# services keep the rest. Its pages are taken as blocks are first written and kept (6.1's brd has no discard):
# it costs its high-water mark. A scratch disk (cube.scratch below) takes its place.
while read -r key kib _; do [ "$key" = MemAvailable: ] && break; done < /proc/meminfo
# e2fsprogs' mke2fs by path (busybox sh runs its own applets first, and that one writes every inode table); inode
# tables are left to lazy init, and never initialised (noinit_itable): a fresh RAM disk reads zeros. Its UUID and
# hash seed come from the kernel's uuid file: mke2fs's own getrandom() blocks until the CRNG is seeded, 4 s of an
# idle guest at this point of a TCG boot.
case " $(cat /proc/cmdline) " in
  *" cube.scratch="*) ;;  # the scratch disk (below) holds /tmp and the homes
  *)
    disk_kib=$((kib * {DISK_SHARE_PCT} / 100))
    if modprobe brd rd_nr=1 rd_size=$disk_kib max_part=0 && modprobe crc32c_generic && modprobe ext4 \
      && /sbin/mke2fs -q -t ext4 -O ^has_journal -m 0 -U "$(cat /proc/sys/kernel/random/uuid)" \
        -E lazy_itable_init=1,nodiscard,hash_seed="$(cat /proc/sys/kernel/random/uuid)" /dev/ram0 \
      && mkdir -p /scratch && mount -t ext4 -o nosuid,nodev,noinit_itable /dev/ram0 /scratch \
      && rmdir /scratch/lost+found && mkdir -p /scratch/tmp /scratch/home/user && chmod 1777 /scratch/tmp \
      && mount --bind /scratch/tmp /tmp && mount --bind /scratch/home/user /home/user; then
      echo "cube-init: /tmp and home on /dev/ram0 ($disk_kib KiB)"
    else  # no RAM disk (its modules missing): /tmp on tmpfs of the same bound, the home on the root
      mount -t tmpfs -o size=${{disk_kib}}k,nosuid,nodev tmpfs /tmp && chmod 1777 /tmp
    fi ;;
esac
chown 1000:1000 /home/user && chmod 0750 /home/user /root
modprobe virtio_pci
modprobe virtio_console
echo "cube-init: kernel $(uname -r)"
# The sandbox policy's devices, only where the host's command line names them (shim/vmm.py guest_cmdline): no
# `cube.net`, no NIC at all (the guest has `lo` only).
ip link set lo up
for arg in $(cat /proc/cmdline); do
  case "$arg" in
    cube.net=*)
      v="${{arg#cube.net=}}"
      modprobe virtio_net && ip link set eth0 up && ip addr add "${{v%,*}}" dev eth0 \
        && ip route add default via "${{v#*,}}" && echo "cube-init: network ${{v%,*}}" ;;
    cube.scratch=*)
      # The workload's writable places (/tmp, the users' homes) live on the capped disk; the rest is root's.
      dev="/dev/${{arg#cube.scratch=}}"
      modprobe virtio_blk && modprobe crc32c_generic && modprobe ext4 && mkdir -p /scratch \
        && mount -t ext4 -o nosuid,nodev,noinit_itable "$dev" /scratch \
        && mkdir -p /scratch/tmp /scratch/home/user /scratch/root && chmod 1777 /scratch/tmp \
        && chown 1000:1000 /scratch/home/user && chmod 0750 /scratch/home/user /scratch/root \
        && mount --bind /scratch/tmp /tmp && mount --bind /scratch/home/user /home/user \
        && mount --bind /scratch/root /root && echo "cube-init: scratch $dev"
      ;;
    cube.ro=*)
      modprobe 9pnet_virtio && modprobe 9p
      for m in $(echo "${{arg#cube.ro=}}" | tr , ' '); do
        mkdir -p "${{m#*:}}" && mount -t 9p -o trans=virtio,version=9p2000.L,ro,nosuid,nodev "${{m%%:*}}" "${{m#*:}}"
      done ;;
  esac
done
export PYTHONPATH={AGENT_HOME} PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 HOME=/root
# The workload service takes its access token from the host at the start of each channel session (not from a
# file): a guest restored from a template snapshot booted before its sandbox, and its token, existed. Commands
# run in a cgroup with pids/memory limits (--limit-commands); a restart tells the host to reconnect.
(
  while true; do
    python3 -m cubeaccel.workload serve --mux-port {WORKLOAD_PORT_NAME} --token-from-channel \\
      --default-user {WORKLOAD_USER} --limit-commands --restart-marker /run/cube-workload.started </dev/null
    echo "cube-init: workload exited $?"
    sleep 1
  done
) &
while true; do
  python3 -m cubeaccel.agent serve --port {AGENT_PORT_NAME} --wait-port 10 --eof wait
  rc=$?
  echo "cube-init: agent exited $rc"
  [ $rc -eq 0 ] && break
  sleep 1
done
# Keep the guest up after a requested agent shutdown: detach still needs a live guest to answer ACPI.
while true; do sleep 3600; done
"""


def _rm(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def prune(root: Path, keep: tuple[str, ...] = (), keep_dynload: tuple[str, ...] = ()) -> None:
    """Remove _PRUNE_DIRS except the `keep` paths under them (set aside and put back), and the extension
    modules whose libraries the image lacks except `keep_dynload` (name prefixes)."""
    aside = root.parent / f"{root.name}.keep"
    for rel in keep:
        if (root / rel).exists():
            (aside / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).replace(aside / rel)
    for rel in _PRUNE_DIRS:
        _rm(root / rel)
    for rel in keep:
        if (aside / rel).exists():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (aside / rel).replace(root / rel)
    shutil.rmtree(aside, ignore_errors=True)
    dynload = root / "usr/lib/python3.11/lib-dynload"
    for so in dynload.glob("*.so"):
        if so.name.startswith(_PRUNE_DYNLOAD_PREFIXES) and not so.name.startswith(keep_dynload or ("\0",)):
            so.unlink()


def extract_adding(debs: list[Path], root: Path, drop: tuple[str, ...]) -> None:
    """Extract `debs` over `root`, then remove what they added under the `drop` directories, and only that: a
    vendor stack's documentation goes, the flavour's kept files there (git's templates) stay."""
    before = {rel: _tree(root / rel) for rel in drop}
    for deb in debs:
        packages.extract(deb, root)
    for rel, kept in before.items():
        for path in sorted(_tree(root / rel) - kept, key=lambda p: len(p.parts), reverse=True):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)


def _tree(top: Path) -> set[Path]:
    if top.is_symlink() or not top.is_dir():
        return {top} if top.is_symlink() or top.exists() else set()
    return {top, *top.rglob("*")}


def install_busybox(root: Path) -> None:
    bb = root / "bin" / "busybox"
    if not bb.exists():
        raise image_error("image.busybox_missing", "busybox-static did not provide /bin/busybox", layer="template")
    for d in ("bin", "sbin", "usr/bin", "usr/sbin", "proc", "sys", "dev", "tmp", "run", "root", "etc", "home/user"):
        (root / d).mkdir(parents=True, exist_ok=True)
    (root / "etc/passwd").write_text(PASSWD)
    (root / "etc/group").write_text(GROUP)
    for applet in _APPLETS:
        link = root / "bin" / applet
        if not link.exists() and not (root / "usr/bin" / applet).exists():  # a package's own tool wins
            link.symlink_to("busybox")
    py = root / "usr/bin/python3"
    if not py.exists():
        py.symlink_to("python3.11")
    init = root / "init"
    init.write_text(INIT_SCRIPT)
    init.chmod(0o755)


# What of cubeaccel runs in the guest (stdlib only; layering contracts in pyproject.toml keep it so). The agent
# imports only `protocol`; `model` rides along because the agent runs the host's own contract judge when a probe
# carries a whole contract (agent/report.py loads `model.contract` by name and reports "unavailable" without it).
GUEST_SOURCE_PACKAGES = ("agent", "workload", "guest", "protocol", "model")


def install_agent(root: Path, src_pkg: Path) -> None:
    """Copy GUEST_SOURCE_PACKAGES into /opt/cubeaccel; the build fails if the agent is absent."""
    dest = root / AGENT_HOME.lstrip("/")
    pkg = dest / "cubeaccel"
    pkg.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src_pkg / "__init__.py", pkg / "__init__.py")
    for sub in GUEST_SOURCE_PACKAGES:
        if (src_pkg / sub).is_dir():
            shutil.copytree(src_pkg / sub, pkg / sub, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    if not (pkg / "agent" / "__main__.py").exists():
        raise image_error("image.agent_missing", f"no cube-agent at {src_pkg / 'agent'}", layer="template")
    if not (pkg / "workload" / "__main__.py").exists():
        raise image_error("image.agent_missing", f"no cube-workload at {src_pkg / 'workload'}", layer="template")


def guest_python(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Run the guest's own python3.11 on the host through the guest's dynamic loader (no chroot, no root)."""
    ld = root / "lib64" / "ld-linux-x86-64.so.2"
    libs = f"{root}/lib/x86_64-linux-gnu:{root}/usr/lib/x86_64-linux-gnu"
    env = {
        "PYTHONHOME": str(root / "usr"),
        "PYTHONPATH": str(root / AGENT_HOME.lstrip("/")),
        "PATH": "/usr/bin:/bin",
        # Reproducible bytecode: a fixed hash seed orders frozenset constants the same way every build (a random
        # one gave a different rootfs digest per build), and imports made here write no timestamped pycs.
        "PYTHONHASHSEED": "0",
        "PYTHONDONTWRITEBYTECODE": "1",
        "SOURCE_DATE_EPOCH": "0",
    }
    cmd = [str(ld), "--library-path", libs, str(root / "usr/bin/python3.11"), *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)


def compile_and_smoke_test(root: Path, more: tuple[str, ...] = ()) -> None:
    """Precompile bytecode with the guest interpreter, then import what cube-agent needs, or fail the build.

    One worker, in sorted order, with a fixed hash seed: marshal's output depends on the compiling process's
    state (interned strings, set ordering), so the same sources must be compiled the same way each build.
    `more`: further trees (relative to the rootfs) compiled the same way, e.g. the userland's dist-packages."""
    script = (
        "import compileall, py_compile, sys\n"
        "mode = py_compile.PycInvalidationMode.UNCHECKED_HASH\n"
        f"ok = compileall.compile_dir(sys.argv[1], ddir='/usr/lib/python3.11', quiet=2, workers=1,"
        " invalidation_mode=mode)\n"
        f"ok &= compileall.compile_dir(sys.argv[2], ddir='{AGENT_HOME}', quiet=2, invalidation_mode=mode)\n"
        "for tree in sys.argv[3:]:\n"
        "    ok &= compileall.compile_dir(tree, ddir=tree[len(sys.argv[1]) - len('/usr/lib/python3.11'):], quiet=2,"
        " workers=1, invalidation_mode=mode)\n"
        "import json, ctypes, hashlib, select, socket, struct, fcntl, termios, pty, tty, lzma, zlib, gzip\n"
        "import cubeaccel.agent.__main__, cubeaccel.workload.__main__, cubeaccel.workload.app\n"
        "sys.exit(0 if ok else 3)\n"
    )
    trees = [str(root / rel) for rel in more]
    proc = guest_python(
        root, "-c", script, str(root / "usr/lib/python3.11"), str(root / AGENT_HOME.lstrip("/")), *trees
    )
    if proc.returncode != 0:
        raise image_error(
            "image.python_broken",
            f"guest python failed to compile or import its modules: {proc.stderr.strip()[-800:]}",
            layer="template",
        )
