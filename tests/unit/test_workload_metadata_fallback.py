"""File metadata where the filesystem has no user xattrs (the guest's root is tmpfs on Linux 6.1, which takes
trusted xattrs only): the workload service keeps it in `trusted.e2b.*`, reads it back, and replaces the whole set
on the next write — the SDK sees what it would see on a filesystem with user xattrs."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cubeaccel.workload import files as fs


@pytest.fixture
def no_user_xattrs(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    real: Callable[..., None] = os.setxattr

    def setxattr(target: int | str, name: str, value: bytes, *args: int) -> None:
        if name.startswith("user."):
            raise OSError(errno.EOPNOTSUPP, "Operation not supported")
        real(target, name, value, *args)

    monkeypatch.setattr(os, "setxattr", setxattr)
    yield


def _write(path: Path, metadata: dict[str, str]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        fs.write_metadata(fd, metadata)
    finally:
        os.close(fd)


@pytest.mark.skipif(os.geteuid() != 0, reason="trusted xattrs need root, as the guest's service is")
def test_metadata_goes_to_trusted_xattrs_survives_a_rename_and_is_replaced_whole(
    tmp_path: Path, no_user_xattrs: None
) -> None:
    f = tmp_path / "a.txt"
    _write(f, {"author": "e2b", "kind": "note"})
    assert sorted(n for n in os.listxattr(f) if "e2b" in n) == ["trusted.e2b.author", "trusted.e2b.kind"]
    assert fs.read_metadata(str(f)) == {"author": "e2b", "kind": "note"}
    moved = tmp_path / "b.txt"
    f.rename(moved)
    assert fs.read_metadata(str(moved)) == {"author": "e2b", "kind": "note"}
    _write(moved, {"author": "other"})  # the whole set is replaced
    assert fs.read_metadata(str(moved)) == {"author": "other"}
    _write(moved, {})  # a write without metadata clears it, as envd's does
    assert fs.read_metadata(str(moved)) == {}


@pytest.mark.skipif(os.geteuid() != 0, reason="trusted xattrs need root, as the guest's service is")
def test_a_users_own_xattr_wins_over_the_fallback(tmp_path: Path) -> None:
    f = tmp_path / "c.txt"
    f.write_text("x")
    os.setxattr(f, "trusted.e2b.author", b"service")
    os.setxattr(f, "user.e2b.author", b"user")
    assert fs.read_metadata(str(f)) == {"author": "user"}
