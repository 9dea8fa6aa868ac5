"""A tenant's sandbox id prefix is a keyed MAC of its name under a per-installation secret (CubeMaster's store), not
an unsalted hash: sandbox ids travel in host names (DNS, SNI) and logs, and anyone who sees one must not be able to
confirm a guessed customer name offline. Tenants made before keep the prefix they had, so ids already issued stay
valid."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import sqlalchemy as sa
from fastapi.testclient import TestClient
from hypothesis import given
from hypothesis import strategies as st

from cubeaccel.master.auth import TENANT
from cubeaccel.master.records import Quota
from cubeaccel.master.schema import SCHEMA_VERSION, TENANT_ID_KEY
from cubeaccel.master.server import create_app
from cubeaccel.master.service import CubeMaster
from cubeaccel.master.store import MasterStore
from cubeaccel.model.ids import tenant_sandbox_prefix, unkeyed_tenant_sandbox_prefix

PREFIX = re.compile(r"t[0-9a-f]{12}-")


def guessed(name: str) -> str:
    """What an observer computes from a guessed customer name: the unsalted hash ids used to carry."""
    return "t" + hashlib.sha256(b"cubeaccel.tenant:" + name.encode()).hexdigest()[:12] + "-"


def whoami_prefix(master: CubeMaster, tenant: str) -> str:
    key = master.auth.create_key(TENANT, tenant)[1]
    r = TestClient(create_app(master)).get("/v1/whoami", headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text
    prefix = r.json()["sandbox_id_prefix"]
    assert isinstance(prefix, str)
    return prefix


def test_a_new_tenants_prefix_cannot_be_confirmed_from_a_guessed_name(tmp_path: Path) -> None:
    prefixes = []
    for install in ("a", "b"):
        master = CubeMaster(MasterStore(str(tmp_path / f"{install}.db")))
        master.auth.create_tenant("acme-corp", Quota())
        prefix = whoami_prefix(master, "acme-corp")
        assert PREFIX.fullmatch(prefix) and prefix != guessed("acme-corp")
        prefixes.append(prefix)
        master.store.close()
    assert prefixes[0] != prefixes[1]  # each installation its own secret


def test_the_prefix_survives_a_restart_and_ids_under_it_are_accepted(tmp_path: Path) -> None:
    db = str(tmp_path / "m.db")
    master = CubeMaster(MasterStore(db))
    master.auth.create_tenant("acme-corp", Quota())
    before = master.auth.sandbox_prefix("acme-corp")
    master.store.close()
    again = CubeMaster(MasterStore(db))
    assert whoami_prefix(again, "acme-corp") == before
    again.store.close()


def test_tenants_made_before_keep_their_unkeyed_prefix_after_the_migration(tmp_path: Path) -> None:
    """A database at v5: tenants without a stored prefix, no secret. After the migration the old tenant's ids
    (issued under the unkeyed prefix) stay its own; a tenant made after gets a keyed one."""
    db = tmp_path / "m.db"
    store = MasterStore(str(db))
    with store.tx() as c:
        c.execute(sa.text("INSERT INTO tenants (name, quota, created_at) VALUES ('old-corp', '{}', 0)"))
    store.close()
    engine = sa.create_engine(f"sqlite:///{db}")
    with engine.begin() as c:
        c.execute(sa.text("ALTER TABLE tenants DROP COLUMN id_prefix"))
        c.execute(sa.text("DELETE FROM meta WHERE key = :k"), {"k": TENANT_ID_KEY})
        c.execute(sa.text("UPDATE meta SET value='5' WHERE key='schema_version'"))
    engine.dispose()

    master = CubeMaster(MasterStore(str(db)))
    assert master.store.schema_version == SCHEMA_VERSION
    assert whoami_prefix(master, "old-corp") == guessed("old-corp")  # ids already issued stay valid
    master.auth.create_tenant("new-corp", Quota())
    assert whoami_prefix(master, "new-corp") != guessed("new-corp")
    with master.store.tx() as c:
        stored = {str(r.name): r.id_prefix for r in c.execute(sa.text("SELECT name, id_prefix FROM tenants"))}
    assert stored == {"old-corp": guessed("old-corp"), "new-corp": master.auth.sandbox_prefix("new-corp")}
    master.store.close()


@given(name=st.text(min_size=1, max_size=40), key=st.binary(min_size=32, max_size=32))
def test_a_keyed_prefix_has_the_id_shape_and_depends_on_the_key(name: str, key: bytes) -> None:
    prefix = tenant_sandbox_prefix(name, key)
    assert PREFIX.fullmatch(prefix)
    assert prefix != tenant_sandbox_prefix(name, bytes(b ^ 1 for b in key))
    assert unkeyed_tenant_sandbox_prefix(name) == guessed(name)
