"""Backups of a state directory while its server runs: SQLite's online backup API, plus the small files that give
the database its meaning (the Cubelet's instance id, which emulated device ids carry; the audit log).

A backup is a directory: `<name>.db` (a consistent snapshot taken page by page under SQLite's own locking, so the
server keeps serving and WAL content is included), the listed side files as they were, and `backup.json` saying
what was taken when. A restore copies them into a fresh state directory, refusing one that already holds a
database or whose lock a running server holds; the server started on it then reconciles as after any restart.
PostgreSQL (CubeMaster replicas) is backed up with `pg_dump` (docs/service.md), not here.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import time
from pathlib import Path
from typing import Any

from cubeaccel.host.service import statelock
from cubeaccel.protocol.errors import CubeError

MANIFEST = "backup.json"


def _fail(message: str, **details: Any) -> CubeError:
    return CubeError("backup.failed", message, "api", details)


def backup(db: Path, side_files: list[Path], out: Path, role: str) -> dict[str, Any]:
    """Snapshot `db` (online) and copy `side_files` that exist into the new directory `out`."""
    if not db.is_file():
        raise _fail(f"no database at {db}", db=str(db))
    if out.exists() and any(out.iterdir()):
        raise _fail(f"{out} exists and is not empty: a backup goes to a new directory", out=str(out))
    out.mkdir(parents=True, exist_ok=True, mode=0o700)
    target = out / db.name
    t0 = time.monotonic()
    try:
        src = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)
        dst = sqlite3.connect(str(target))
        try:
            src.backup(dst, pages=1024)  # in steps: the server's writers are never blocked for the whole copy
            check = dst.execute("PRAGMA integrity_check").fetchone()[0]
            tables = {
                r[0]: dst.execute(f'SELECT count(*) FROM "{r[0]}"').fetchone()[0]
                for r in dst.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
            }
        finally:
            dst.close()
            src.close()
    except sqlite3.Error as e:
        raise _fail(f"backup of {db} failed: {e}", db=str(db)) from e
    if check != "ok":
        raise _fail(f"the backup of {db} does not pass integrity_check: {check}", db=str(db))
    os.chmod(target, 0o600)
    copied = []
    for f in side_files:
        if f.is_file():
            shutil.copy2(f, out / f.name)
            os.chmod(out / f.name, 0o600)
            copied.append(f.name)
    info = {
        "role": role,
        "database": db.name,
        "source": str(db),
        "files": copied,
        "rows": tables,
        "taken_at": time.time(),
        "seconds": round(time.monotonic() - t0, 3),
    }
    (out / MANIFEST).write_text(json.dumps(info, indent=2) + "\n")
    return info


def restore(backup_dir: Path, state_dir: Path, role: str) -> dict[str, Any]:
    """Copy a backup into `state_dir` (created 0700), which must hold no database of `role`'s and no live server."""
    try:
        info = json.loads((backup_dir / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise _fail(f"{backup_dir} is not a backup (no readable {MANIFEST})", backup=str(backup_dir)) from e
    if info.get("role") != role:
        raise _fail(f"{backup_dir} is a {info.get('role')} backup, not a {role} one", backup=str(backup_dir))
    lock = statelock.acquire(state_dir, role)  # no server may run here while its files are replaced
    try:
        if (state_dir / info["database"]).exists():
            raise _fail(
                f"{state_dir} already holds {info['database']}: restore into a fresh state directory",
                state_dir=str(state_dir),
            )
        with sqlite3.connect(str(backup_dir / info["database"])) as db:
            check = db.execute("PRAGMA integrity_check").fetchone()[0]
        if check != "ok":
            raise _fail(f"the backup's database fails integrity_check: {check}", backup=str(backup_dir))
        for name in [info["database"], *info.get("files", [])]:
            shutil.copy2(backup_dir / name, state_dir / name)
            os.chmod(state_dir / name, 0o600)
    finally:
        lock.release()
    return {**info, "restored_to": str(state_dir)}
