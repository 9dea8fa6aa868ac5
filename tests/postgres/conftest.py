"""A throwaway PostgreSQL cluster for the session: initdb in a temp dir, unix socket only, no TCP.

Root cannot run initdb, so as root the server runs as the `postgres` user (`runuser`). Skipped, with the
reason, only when the PostgreSQL binaries are not installed (`.ci/run` installs them).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.support.pg_cluster import PgCluster, pg_binary


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    if pg_binary("initdb") is None or pg_binary("pg_ctl") is None:
        if os.environ.get("CUBEACCEL_REQUIRE_VM"):  # CI: every suite must really run
            pytest.fail("PostgreSQL server binaries are missing but CI requires the replica tests")
        pytest.skip("PostgreSQL server binaries (initdb, pg_ctl) are not installed; install postgresql")
    cluster = PgCluster()
    try:
        yield cluster.url
    finally:
        cluster.stop()


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
