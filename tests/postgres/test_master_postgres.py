"""Two CubeMaster replicas on one real PostgreSQL never double-place."""

from __future__ import annotations

import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from cubeaccel.master.schema import SCHEMA_VERSION
from cubeaccel.master.store import MasterStore
from cubeaccel.transport.master_client import Calls, MasterClient
from tests.support.cubelet_process import CubeletProcess
from tests.support.master_harness import MasterProcess, cubelet, example, wait_nodes_ready
from tests.support.poll import poll

pytestmark = pytest.mark.postgres


def test_replicas_starting_together_migrate_once(fresh_db: str) -> None:
    stores: list[MasterStore] = []
    threads = [threading.Thread(target=lambda: stores.append(MasterStore(fresh_db))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [s.schema_version for s in stores] == [SCHEMA_VERSION] * 4 and stores[0].dialect == "postgresql"
    for s in stores:
        s.close()


def test_two_replicas_200_concurrent_creates_against_16_devices_place_exactly_16(fresh_db: str, tmp_path: Path) -> None:
    replicas = [MasterProcess(tmp_path / f"m{i}", db=fresh_db, staleness=5.0).start() for i in range(2)]
    nodes: list[CubeletProcess] = []
    try:
        for i, m in enumerate(replicas):  # each node heartbeats to a different replica
            (tmp_path / f"n{i}").mkdir()
            nodes.append(cubelet(tmp_path / f"n{i}", "h100x8", f"n{i}", m.url).start())
        wait_nodes_ready(replicas[0].client, {"n0", "n1"})
        replicas[0].client.register_template(example("cuda12-h100", spec__memory__size_mib=1024), default=True)

        def create(i: int) -> tuple[int, str]:
            url = replicas[i % 2].url
            r = httpx.post(
                f"{url}/v1/sandboxes",
                json={"gpu": "H100:1", "id": f"sb-{i}"},
                headers=replicas[0].headers(),
                timeout=120,
            )
            body = r.json()
            return r.status_code, body["id"] if r.status_code == 201 else body["error"]["code"]

        with ThreadPoolExecutor(max_workers=50) as pool:
            results = list(pool.map(create, range(200)))
        statuses = Counter(s for s, _ in results)
        assert statuses == {201: 16, 409: 184}, Counter(results)
        # Refusals say "no capacity" (unschedulable) or, for a create that lost every claim it tried to a
        # concurrent placement, "retry" (placement_failed); never anything that would hide a double placement.
        codes = {code for s, code in results if s == 409}
        assert "schedule.unschedulable" in codes and codes <= {"schedule.unschedulable", "schedule.placement_failed"}
        placed = {sid for s, sid in results if s == 201}

        # the Cubelets' truth: 16 devices, each in exactly one sandbox, and those are the placed ones
        holders = [d.sandbox_id for n in nodes for d in n.client.devices() if d.sandbox_id]
        assert len(holders) == 16 and set(holders) == placed
        rows = replicas[1].client.sandboxes("running")
        assert {r.id for r in rows} == placed
        devices = [(r.node, d) for r in rows for d in r.device_ids]
        assert len(devices) == len(set(devices)) == 16
        poll(lambda: all(n.allocatable == 0 for n in replicas[1].client.nodes()))
    finally:
        for n in nodes:
            n.stop()
        for m in replicas:
            m.stop()


def test_the_same_create_sent_to_both_replicas_makes_one_sandbox(fresh_db: str, tmp_path: Path) -> None:
    replicas = [MasterProcess(tmp_path / f"m{i}", db=fresh_db).start() for i in range(2)]
    (tmp_path / "n").mkdir()
    node = cubelet(tmp_path / "n", "h100x8", "n", replicas[0].url).start()
    try:
        wait_nodes_ready(replicas[1].client, {"n"})
        replicas[1].client.register_template(example("cuda12-h100", spec__memory__size_mib=1024), default=True)

        def create(i: int) -> int:
            r = httpx.post(
                f"{replicas[i % 2].url}/v1/sandboxes",
                json={"gpu": "H100:1"},
                headers={"Idempotency-Key": "same-request", **replicas[0].headers()},
                timeout=60,
            )
            return r.status_code

        with ThreadPoolExecutor(max_workers=10) as pool:
            codes = list(pool.map(create, range(10)))
        assert codes.count(201) == 1 and set(codes) <= {200, 201}
        assert len([d for d in node.client.devices() if d.sandbox_id]) == 1
    finally:
        node.stop()
        for m in replicas:
            m.stop()


def test_50_concurrent_creates_from_a_tenant_with_a_4_gpu_quota_through_two_replicas_admit_exactly_4(
    fresh_db: str, tmp_path: Path
) -> None:
    replicas = [MasterProcess(tmp_path / f"m{i}", db=fresh_db, staleness=5.0).start() for i in range(2)]
    nodes: list[CubeletProcess] = []
    try:
        for i, m in enumerate(replicas):
            (tmp_path / f"n{i}").mkdir()
            nodes.append(cubelet(tmp_path / f"n{i}", "h100x8", f"n{i}", m.url).start())
        wait_nodes_ready(replicas[0].client, {"n0", "n1"})
        replicas[0].client.register_template(example("cuda12-h100", spec__memory__size_mib=1024), default=True)
        quota = {"max_accelerators": {"gpu": 4}}
        key = replicas[0].client.request("POST", "/v1/tenants", {"name": "q4", "quota": quota})["key"]
        me = MasterClient(replicas[1].url, key=key)  # the other replica: the prefix is the database's, not one's
        prefix = me.call(Calls.whoami()).sandbox_id_prefix
        me.close()

        def create(i: int) -> tuple[int, str]:
            r = httpx.post(
                f"{replicas[i % 2].url}/v1/sandboxes",
                json={"gpu": "H100:1", "id": f"{prefix}q-{i}"},  # its own id namespace
                headers={"Authorization": f"Bearer {key}"},
                timeout=120,
            )
            body = r.json()
            return r.status_code, body["id"] if r.status_code == 201 else body["error"]["code"]

        with ThreadPoolExecutor(max_workers=50) as pool:
            results = list(pool.map(create, range(50)))
        assert Counter(s for s, _ in results) == {201: 4, 429: 46}, Counter(results)
        assert {code for s, code in results if s == 429} == {"quota.accelerators"}
        placed = {sid for s, sid in results if s == 201}
        holders = [d.sandbox_id for n in nodes for d in n.client.devices() if d.sandbox_id]
        assert set(holders) == placed and len(holders) == 4

        tenant = MasterClient(replicas[1].url, key=key)
        for sid in placed:
            tenant.delete(sid)
        poll(lambda: all(s.state == "deleted" for s in tenant.sandboxes()), 60)
        again = [create(100 + i) for i in range(5)]  # the quota is free again: 4 more, then refused
        assert [s for s, _ in again] == [201, 201, 201, 201, 429], again
        tenant.close()
    finally:
        for n in nodes:
            n.stop()
        for m in replicas:
            m.stop()


def test_idempotent_creates_racing_on_two_replicas_agree_on_every_outcome(fresh_db: str) -> None:
    """Issue 19 #4 on PostgreSQL: no UniqueViolation escapes, no phantom, one placement per key."""
    from tests.unit.test_master_idempotency import race

    race(fresh_db, keys=20, per_key=8)
