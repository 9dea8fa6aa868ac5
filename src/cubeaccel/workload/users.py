"""Users and paths as envd resolves them (envd internal/permissions): home-relative, `~` expanded, no confinement.

envd's file API runs as root and trusts the sandbox's owner with the whole guest; relative paths resolve against
the user's home (`a/../b` cleaned lexically), absolute ones are used as given and the kernel follows symlinks.
"""

from __future__ import annotations

import contextlib
import grp
import os
import pwd
import stat
from dataclasses import dataclass

from cubeaccel.workload.connect import ConnectError


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int
    home: str

    def groups(self) -> list[int]:
        try:
            return os.getgrouplist(self.name, self.gid)
        except OSError:
            return [self.gid]


def lookup(name: str) -> User:
    """The user by name; `KeyError` if there is none."""
    entry = pwd.getpwnam(name)
    return User(entry.pw_name, entry.pw_uid, entry.pw_gid, entry.pw_dir)


def owner_names(uid: int, gid: int) -> tuple[str, str]:
    try:
        owner = pwd.getpwuid(uid).pw_name
    except KeyError:
        owner = str(uid)
    try:
        group = grp.getgrgid(gid).gr_name
    except KeyError:
        group = str(gid)
    return owner, group


def expand_and_resolve(path: str, user: User, default_workdir: str | None) -> str:
    if not path and default_workdir:
        path = default_workdir
    if path.startswith("~"):
        if len(path) > 1 and path[1] not in "/\\":
            raise ConnectError(
                "invalid_argument",
                f"failed to expand path '{path}' for user '{user.name}': cannot expand user-specific home dir",
            )
        path = os.path.join(user.home, path[1:].lstrip("/\\")) if len(path) > 1 else user.home
        path = os.path.normpath(path)
    if os.path.isabs(path):
        return path
    return os.path.normpath(os.path.join(user.home, path))


def ensure_dirs(path: str, user: User) -> None:
    """Create missing directories along `path`, owned by the user (envd EnsureDirs)."""
    parts: list[str] = []
    current = path
    while current not in ("/", ""):
        parts.append(current)
        current = os.path.dirname(current)
    for sub in reversed(parts):
        try:
            st = os.stat(sub)
        except FileNotFoundError:
            with contextlib.suppress(FileExistsError):  # another upload made it meanwhile: still ours to chown
                os.mkdir(sub, 0o755)
            chown(sub, user)
            continue
        if not stat.S_ISDIR(st.st_mode):
            raise ConnectError("internal", f"path is a file: {sub}")


def chown(path: str, user: User) -> None:
    """Give the user what we created for them; only root can, and only root needs to. Root chowns to root
    too, as envd does: a directory watch sees the same events (IN_ATTRIB) whoever the user is."""
    if os.geteuid() == 0:
        os.chown(path, user.uid, user.gid, follow_symlinks=False)
