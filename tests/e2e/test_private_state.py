"""Issue 19 #12: state files and sockets are owner-only whatever the parent directory and the caller's umask.

`master.db` was 0644 in a 0755 directory and was read by user `nobody`; the Cubelet's socket was 0666 (uvicorn
chmods the unix sockets it creates), so any local user could post shim reports.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.cubelet_process import CubeletProcess
from tests.support.master_harness import MasterProcess


@pytest.fixture
def open_umask() -> Iterator[None]:
    old = os.umask(0o022)  # what a login shell usually has: the daemons must not inherit it
    yield
    os.umask(old)


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_daemons_create_their_state_owner_only(tmp_path: Path, open_umask: None) -> None:
    cub_dir, m_dir = tmp_path / "cubelet", tmp_path / "master"
    for d in (cub_dir, m_dir):
        d.mkdir(mode=0o755)
        d.chmod(0o755)
    cub = CubeletProcess(cub_dir).start()
    master = MasterProcess(m_dir).start()
    try:
        assert master.client.health().status == "ok"
        assert _mode(cub_dir / "cubelet.sock") == 0o600
        assert _mode(cub_dir / "cubelet.db") == 0o600
        assert _mode(m_dir / "master.db") == 0o600
        for side in ("-wal", "-shm"):
            for db in (cub_dir / "cubelet.db", m_dir / "master.db"):
                extra = db.with_name(db.name + side)
                if extra.exists():
                    assert _mode(extra) == 0o600, extra
        assert cub.client.health().status == "ok"  # the owner still connects
    finally:
        cub.stop()
        master.stop()


def test_an_existing_world_readable_master_db_is_tightened(tmp_path: Path, open_umask: None) -> None:
    from cubeaccel.master.store import MasterStore

    db = tmp_path / "master.db"
    MasterStore(str(db)).close()
    db.chmod(0o644)
    MasterStore(str(db)).close()
    assert _mode(db) == 0o600
