"""Sockets in directories too deep for AF_UNIX's 108-byte address: what a long state directory does to a VMM's
QMP and agent sockets (the VMM binds by relative name; clients connect through `connect_path`)."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from cubeaccel.host.service.unix_path import SUN_PATH_MAX, connect_path


def _deep(tmp_path: Path) -> Path:
    d = tmp_path / ("d" * 60) / ("e" * 60)
    d.mkdir(parents=True)
    return d


def _serve_relative(directory: Path, name: str) -> subprocess.Popen[bytes]:
    """A server that binds `name` relative to its cwd, as QEMU does with `path=qmp.sock`."""
    code = (
        "import socket,sys;s=socket.socket(socket.AF_UNIX);s.bind(sys.argv[1]);s.listen();print('up',flush=True);"
        "c,_=s.accept();c.sendall(b'hello');c.close()"
    )
    p = subprocess.Popen([sys.executable, "-c", code, name], cwd=directory, stdout=subprocess.PIPE)
    assert p.stdout is not None and p.stdout.readline() == b"up\n"
    return p


def test_a_socket_too_deep_for_its_full_path_is_still_reached(tmp_path: Path) -> None:
    d = _deep(tmp_path)
    full = d / "qmp.sock"
    assert len(str(full)) > SUN_PATH_MAX
    with socket.socket(socket.AF_UNIX) as s, pytest.raises(OSError):
        s.connect(str(full))  # what failed before: "AF_UNIX path too long"
    server = _serve_relative(d, "qmp.sock")
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(connect_path(full))
            assert s.recv(5) == b"hello"
    finally:
        assert server.wait(timeout=10) == 0


def test_a_short_path_is_used_as_it_is(tmp_path: Path) -> None:
    short = Path("/tmp") / "x.sock"
    assert connect_path(short) == "/tmp/x.sock"


def test_a_replaced_directory_is_opened_again(tmp_path: Path) -> None:
    d = _deep(tmp_path)
    connect_path(d / "a.sock")
    d.rename(d.with_name("old"))
    d.mkdir()
    server = _serve_relative(d, "a.sock")
    try:
        again = connect_path(d / "a.sock")
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(again)
            assert s.recv(5) == b"hello"
    finally:
        assert server.wait(timeout=10) == 0
