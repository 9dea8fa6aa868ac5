"""A throwaway PostgreSQL cluster for the session: initdb in a temp dir, unix socket only, no TCP.

Root cannot run initdb, so as root the server runs as the `postgres` user (`runuser`). Skipped, with the
reason, only when the PostgreSQL binaries are not installed (`.ci/run` installs them).
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


def pg_binary(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return candidates[-1] if candidates else None


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    initdb, pg_ctl = pg_binary("initdb"), pg_binary("pg_ctl")
    if initdb is None or pg_ctl is None:
        if os.environ.get("CUBEACCEL_REQUIRE_VM"):  # CI: every suite must really run
            pytest.fail("PostgreSQL server binaries are missing but CI requires the replica tests")
        pytest.skip("PostgreSQL server binaries (initdb, pg_ctl) are not installed; install postgresql")
    as_pg: list[str] = []
    root = Path(tempfile.mkdtemp(prefix="cubeaccel-pg-"))
    if os.geteuid() == 0:
        as_pg = ["runuser", "-u", "postgres", "--"]
        shutil.chown(root, "postgres", "postgres")
    data = root / "data"
    subprocess.run(
        [*as_pg, initdb, "-D", str(data), "-U", "postgres", "--auth=trust", "-E", "UTF8", "-N"],
        check=True,
        capture_output=True,
    )
    opts = f"-c listen_addresses='' -k {root} -c fsync=off -c synchronous_commit=off -c max_connections=300"
    subprocess.run(
        [*as_pg, pg_ctl, "-D", str(data), "-o", opts, "-l", str(root / "postgres.log"), "-w", "-t", "60", "start"],
        check=True,
        capture_output=True,
    )
    try:
        yield f"postgresql://postgres@/postgres?host={root}"
    finally:
        subprocess.run([*as_pg, pg_ctl, "-D", str(data), "-m", "immediate", "-w", "stop"], capture_output=True)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def fresh_db(postgres_url: str) -> Iterator[str]:
    """A database of its own for one test (CREATE DATABASE on the throwaway cluster)."""
    import sqlalchemy as sa

    name = f"t_{os.urandom(4).hex()}"
    admin = sa.create_engine(
        postgres_url.replace("postgresql://", "postgresql+psycopg://", 1), isolation_level="AUTOCOMMIT"
    )
    with admin.connect() as c:
        c.execute(sa.text(f"CREATE DATABASE {name}"))
    try:
        yield postgres_url.replace("/postgres?", f"/{name}?", 1)
    finally:
        admin.dispose()
