"""A tenant whose lifetime cap is below CubeMaster's default can create without naming a timeout: the default
is its cap (issue 30 #9); only an explicit timeout over the cap is refused."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cubeaccel.master.auth import TENANT
from cubeaccel.master.records import Quota
from tests.unit.test_tenant_isolation import Stack


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    s = Stack(tmp_path)
    s.master.auth.create_tenant("short", Quota(max_lifetime_s=600.0))  # CubeMaster's default is 3600 s
    s.keys["short"] = s.master.auth.create_key(TENANT, "short")[1]
    yield s
    s.master.store.close()


def test_a_create_without_timeout_lives_as_long_as_the_tenants_cap(stack: Stack) -> None:
    t0 = time.time()
    r = stack.create("short", stack.master.auth.sandbox_prefix("short") + "a")
    assert r.status_code in (200, 201), r.text
    assert t0 + 590 <= r.json()["expires_at"] <= time.time() + 600


def test_an_explicit_timeout_over_the_cap_is_still_refused(stack: Stack) -> None:
    r = stack.create("short", stack.master.auth.sandbox_prefix("short") + "b", timeout_s=601)
    assert r.status_code == 422 and r.json()["error"]["code"] == "quota.lifetime"
