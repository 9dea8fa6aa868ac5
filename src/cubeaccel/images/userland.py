"""The userland flavour: a guest whose login shell has what E2B's `base` template has, from Debian packages.

The validation image carries only what cube-agent and `bash -l -c` need. Sandboxes that users drive through the
E2B SDK run arbitrary shell: git, curl (with CA certificates), sudo (user `user` needs no password), ncurses'
`tput`, python3 (also as `python`) with pip, procps, findutils, grep, sed, gawk. Those packages and every shared
library they load are extracted into the same kind of rootfs (no dpkg, no maintainer scripts), so what the scripts
would have done is done here: the CA bundle, the `awk` and `python` links, sudo's setuid bit and configuration, a
PAM stack with no passwords.
`USERLAND_LIBRARIES` is checked at build time: every ELF file the flavour ships must find its libraries.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from cubeaccel.images import vendor
from cubeaccel.images.flavour import Flavour
from cubeaccel.images.packages import image_error

# The tools (what a user types) and the libraries they load, as `apt-cache depends` names them (first alternative;
# tests/unit/test_userland_image.py checks the list is closed under their library dependencies).
USERLAND_TOOLS = (
    "findutils",
    "grep",
    "sed",
    "gawk",
    "git",
    "curl",
    "ca-certificates",
    "sudo",
    "ncurses-bin",
    "ncurses-base",
    "procps",
    "python3-pip",
    "python3-setuptools",
    "python3-wheel",
    "python3-distutils",
    "python3-pkg-resources",
    "debianutils",
    "tar",
    "gzip",
    "attr",
)
USERLAND_LIBRARIES = (
    "libaudit1",
    "libaudit-common",
    "libbrotli1",
    "libcap-ng0",
    "libcap2",
    "libcrypt1",
    "libcurl3-gnutls",
    "libcurl4",
    "libdb5.3",
    "libgcc-s1",
    "libgcrypt20",
    "libgnutls30",
    "libgpg-error0",
    "libgssapi-krb5-2",
    "libhogweed6",
    "libidn2-0",
    "libk5crypto3",
    "libkeyutils1",
    "libkrb5-3",
    "libkrb5support0",
    "libldap-2.5-0",
    "liblz4-1",
    "libmpfr6",
    "libncursesw6",
    "libnettle8",
    "libnghttp2-14",
    "libnsl2",
    "libp11-kit0",
    "libpam-modules",
    "libpam0g",
    "libproc2-0",
    "libpsl5",
    "libreadline8",
    "librtmp1",
    "libsasl2-2",
    "libsasl2-modules-db",
    "libsigsegv2",
    "libsqlite3-0",
    "libssh2-1",
    "libsystemd0",
    "libtasn1-6",
    "libtirpc-common",
    "libtirpc3",
    "libunistring2",
    "libzstd1",
)

# Kept out of the validation prune: the CA bundle, sudo's plugins, git's templates, python modules user code imports.
_KEEP = (
    "etc/ssl/certs/ca-certificates.crt",  # written by before_prune
    "usr/libexec/sudo",
    "usr/share/git-core/templates",
    "usr/lib/python3.11/distutils",
    "usr/lib/python3.11/sqlite3",
    "usr/lib/python3.11/curses",
    "usr/lib/python3.11/pydoc_data",
)
_KEEP_DYNLOAD = ("_sqlite3", "_curses", "readline")
# Parts of the packages a sandbox never runs (servers, mail, interactive perl helpers without a perl to run them).
# Not `git daemon`: E2B's base has it, and E2B's own git tests start one as their remote.
_DROP = (
    "usr/lib/git-core/git-http-backend",
    "usr/lib/git-core/git-http-push",
    "usr/lib/git-core/git-imap-send",
    "usr/lib/git-core/git-shell",
    "usr/lib/git-core/scalar",
    "usr/bin/scalar",
    "usr/bin/git-shell",
    "usr/sbin/sudo_logsrvd",
    "usr/sbin/sudo_sendlog",
    "usr/lib/python3.11/EXTERNALLY-MANAGED",
)
# E2B base's userland, as a shell finds it (`command -v`, git's subcommands), and the file providing each: the
# build checks every one is there, in the userland image and in every image built on it (a vendor stack adds to
# the userland, never replaces a part of it).
BASE_USERLAND: dict[str, str] = {
    "ls": "bin/ls",
    "sort": "usr/bin/sort",
    "xargs": "usr/bin/xargs",
    "find": "usr/bin/find",
    "grep": "bin/grep",
    "sed": "bin/sed",
    "awk": "usr/bin/awk",
    "git": "usr/bin/git",
    "git daemon": "usr/lib/git-core/git-daemon",
    "git init's templates": "usr/share/git-core/templates",
    "curl": "usr/bin/curl",
    "CA bundle": "etc/ssl/certs/ca-certificates.crt",
    "sudo": "usr/bin/sudo",
    "tput": "usr/bin/tput",
    "xterm terminfo": "lib/terminfo/x/xterm",
    "python3": "usr/bin/python3",
    "python": "usr/bin/python",
    "pip": "usr/bin/pip",
    "ps": "bin/ps",
    "setfattr": "usr/bin/setfattr",
}
# Where ELF files whose libraries the build checks live.
_ELF_DIRS = ("bin", "sbin", "usr/bin", "usr/sbin", "usr/lib/git-core", "usr/libexec/sudo")

SUDOERS = """\
# cubeaccel userland: as in E2B's base template, the sandbox's user may become root without a password.
Defaults env_reset
Defaults secure_path="/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
root ALL=(ALL:ALL) ALL
user ALL=(ALL:ALL) NOPASSWD: ALL
"""
# No account has a password, so password authentication always fails; root and NOPASSWD rules never ask.
PAM_SUDO = "auth required pam_deny.so\naccount required pam_permit.so\nsession required pam_permit.so\n"
PROFILE = """\
# cubeaccel userland: read by the workload's login shells (`bash -l -c`, as the E2B SDK runs commands).
export TERM="${TERM:-xterm}"
export LANG="${LANG:-C.UTF-8}"
if [ -d "$HOME/.local/bin" ]; then PATH="$HOME/.local/bin:$PATH"; fi
"""
HOSTS = "127.0.0.1 localhost\n127.0.1.1 sandbox\n::1 localhost ip6-localhost ip6-loopback\n"  # init names the host
NSSWITCH = "passwd: files\ngroup: files\nshadow: files\nhosts: files dns\n"
CA_BUNDLE = "etc/ssl/certs/ca-certificates.crt"
SETUID = ("usr/bin/sudo",)


def before_prune(root: Path) -> None:
    """What maintainer scripts do from files the prune removes: the CA bundle (update-ca-certificates)."""
    certs = sorted((root / "usr/share/ca-certificates").rglob("*.crt"))
    if not certs:
        raise image_error("image.userland_incomplete", "ca-certificates provided no certificates", layer="template")
    bundle = root / CA_BUNDLE
    bundle.parent.mkdir(parents=True, exist_ok=True)
    bundle.write_bytes(b"".join(c.read_bytes().rstrip(b"\n") + b"\n" for c in certs))


def install(root: Path) -> None:
    """After the prune and the base install: configuration, links update-alternatives would make, drops, and a
    check that every shipped ELF file finds its shared libraries in the rootfs."""
    for rel in _DROP:
        p = root / rel
        if p.is_symlink() or p.is_file():
            p.unlink()
    git_copy = root / "usr/lib/git-core/git"
    if git_copy.is_file() and not git_copy.is_symlink():  # a second 3.7 MB copy of /usr/bin/git
        git_copy.unlink()
        git_copy.symlink_to("../../bin/git")
    etc = root / "etc"
    (etc / "sudoers.d").mkdir(parents=True, exist_ok=True)
    (etc / "pam.d").mkdir(exist_ok=True)
    (etc / "sudoers").write_text(SUDOERS)
    (etc / "pam.d/sudo").write_text(PAM_SUDO)
    (etc / "pam.d/other").write_text("auth required pam_deny.so\naccount required pam_deny.so\n")
    (etc / "profile").write_text(PROFILE)
    (etc / "hosts").write_text(HOSTS)
    (etc / "nsswitch.conf").write_text(NSSWITCH)
    (etc / "shadow").write_text("root:*:19000:0:99999:7:::\nuser:*:19000:0:99999:7:::\n")
    ssl = root / "usr/lib/ssl"  # OpenSSL's (and python's ssl) default paths; the openssl package would make them
    ssl.mkdir(parents=True, exist_ok=True)
    _link(ssl / "certs", "/etc/ssl/certs")
    _link(ssl / "cert.pem", f"/{CA_BUNDLE}")
    _link(root / "usr/bin/awk", "gawk")
    _link(root / "usr/bin/python", "python3")  # what python-is-python3 makes: E2B base users (and tests) type `python`
    for rel in SETUID:
        if not (root / rel).is_file():
            raise image_error("image.userland_incomplete", f"/{rel} is missing", layer="template")
    elves = [p for d in _ELF_DIRS for p in sorted((root / d).glob("*")) if _is_elf(p)]
    dynload = root / "usr/lib/python3.11/lib-dynload"
    elves += sorted(dynload.glob("*.so"))
    if missing := vendor.missing_libraries(root, elves):
        raise image_error(
            "image.userland_incomplete",
            f"shared libraries missing from the userland rootfs: {missing}",
            layer="template",
            missing=missing,
        )


def check_base(root: Path) -> None:
    """Every part of BASE_USERLAND is in `root` (a link counts where its target, inside the rootfs, is there),
    or the build fails naming what is missing."""
    missing = [name for name, rel in BASE_USERLAND.items() if not _present(root, rel)]
    if missing:
        raise image_error(
            "image.userland_incomplete",
            f"the image lacks part of the base userland: {', '.join(missing)}",
            layer="template",
            missing=missing,
        )


def _present(root: Path, rel: str) -> bool:
    path = root / rel
    for _ in range(8):  # links inside the rootfs, resolved against it (never the host's own files)
        if not path.is_symlink():
            return path.exists()
        target = os.readlink(path)
        path = root / target.lstrip("/") if target.startswith("/") else path.parent / target
    return False


def _link(path: Path, target: str) -> None:
    if path.is_symlink() or path.exists():
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    path.symlink_to(target)


def _is_elf(path: Path) -> bool:
    if path.is_symlink() or not path.is_file() or not os.access(path, os.X_OK):
        return False
    with path.open("rb") as f:
        return f.read(4) == b"\x7fELF"


USERLAND = Flavour(
    "userland",
    "userland",
    packages=USERLAND_TOOLS + USERLAND_LIBRARIES,
    keep=_KEEP,
    keep_dynload=_KEEP_DYNLOAD,
    precompile=("usr/lib/python3/dist-packages",),
    modes={"usr/bin/sudo": 0o4755, "etc/sudoers": 0o440},
    before_prune=before_prune,
    install=install,
    check=check_base,
)
