"""CubeMaster's typed records on PostgreSQL: a create row is stored as the dict-based code stored it, and the rows
that code wrote are read and shown the same (tests/unit/test_master_records.py runs these on SQLite)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import given, settings
from hypothesis import strategies as st

from cubeaccel.master.store import MasterStore
from tests.support.stored_rows import normalized_requests
from tests.unit.test_master_records import (
    STORED,
    assert_creates_store_the_same,
    assert_read_and_shown_the_same,
)

pytestmark = pytest.mark.postgres


@pytest.fixture
def stores(fresh_db: str, postgres_url: str) -> Iterator[tuple[MasterStore, MasterStore]]:
    """Two databases of their own: the dict-based code's writes, and the typed store's."""
    name = f"t_{os.urandom(4).hex()}"
    admin = sa.create_engine(
        postgres_url.replace("postgresql://", "postgresql+psycopg://", 1), isolation_level="AUTOCOMMIT"
    )
    with admin.connect() as c:
        c.execute(sa.text(f"CREATE DATABASE {name}"))
    old, new = MasterStore(fresh_db), MasterStore(postgres_url.replace("/postgres?", f"/{name}?", 1))
    try:
        yield old, new
    finally:
        old.close()
        new.close()
        with admin.connect() as c:
            c.execute(sa.text(f"DROP DATABASE {name}"))
        admin.dispose()


def test_a_create_row_is_stored_as_the_dict_based_code_stored_it(stores: tuple[MasterStore, MasterStore]) -> None:
    old, new = stores

    @settings(max_examples=60, deadline=None)
    @given(request=normalized_requests(), keyed=st.booleans())
    def check(request: dict[str, Any], keyed: bool) -> None:
        assert_creates_store_the_same(old, new, request, keyed)

    check()


@pytest.mark.parametrize("over", STORED, ids=[r["state"] for r in STORED])
def test_a_row_the_dict_based_code_wrote_is_read_and_shown_the_same(
    stores: tuple[MasterStore, MasterStore], over: dict[str, Any]
) -> None:
    assert_read_and_shown_the_same(stores[0], over)
