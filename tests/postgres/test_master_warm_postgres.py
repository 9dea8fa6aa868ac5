"""Warm claims through two CubeMaster replicas on one real PostgreSQL (docs/warm.md): never one warm sandbox for
two creates; a replica SIGKILLed mid-claim converges. Real Cubelet processes on the simulated host (its shim
driver is in-process; the claim, the journal CAS and the heartbeat are the real ones)."""

from __future__ import annotations

import os
import signal
import threading
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from cubeaccel.transport.master_client import Calls, MasterClient
from tests.e2e.test_master_warm import TEMPLATE, advertised, path_entries, warm_pool
from tests.support.cubelet_process import CubeletProcess
from tests.support.master_harness import MasterProcess, cubelet, wait_nodes_ready
from tests.support.poll import poll
from tests.support.warm import claimed_warm_ids, request_waiting_on

pytestmark = pytest.mark.postgres


@pytest.fixture
def replicas(fresh_db: str, tmp_path: Path) -> Iterator[list[MasterProcess]]:
    ms = [
        MasterProcess(tmp_path / f"m{i}", fresh_db, 5.0, "--cubelet-timeout", "10").start()  # abandoned after 20 s
        for i in range(2)
    ]
    try:
        yield ms
    finally:
        for m in ms:
            m.stop()


def _frozen_pool(m: MasterProcess, node: CubeletProcess, name: str, size: int) -> set[str]:
    """`size` warm sandboxes, then no refill: the pool is exactly those."""
    warm_pool(node, size)
    poll(lambda: [p.warm for p in advertised(m, name)] == [size], 90)
    warm_pool(node, 0)
    return set(advertised(m, name)[0].sandboxes)


def test_20_concurrent_creates_on_two_replicas_against_4_warm_sandboxes_hand_each_out_once(
    replicas: list[MasterProcess], tmp_path: Path
) -> None:
    nodes: list[CubeletProcess] = []
    try:
        for i, m in enumerate(replicas):  # each node heartbeats to a different replica
            nodes.append(cubelet(tmp_path / f"n{i}", "h100x8", f"n{i}", m.url).start())
        wait_nodes_ready(replicas[0].client, {"n0", "n1"})
        replicas[0].client.register_template(TEMPLATE, default=True)
        warm = _frozen_pool(replicas[1], nodes[0], "n0", 4)
        quota = {"max_accelerators": {"gpu": 10}}
        key = replicas[0].client.request("POST", "/v1/tenants", {"name": "w10", "quota": quota})["key"]
        me = MasterClient(replicas[1].url, key=key)  # the other replica: the prefix is the database's, not one's
        prefix = me.call(Calls.whoami()).sandbox_id_prefix
        me.close()
        go = threading.Barrier(20)

        def create(i: int) -> tuple[int, str]:
            go.wait()
            r = httpx.post(
                f"{replicas[i % 2].url}/v1/sandboxes",
                json={"gpu": "H100:1", "id": f"{prefix}w-{i}"},
                headers={"Authorization": f"Bearer {key}"},
                timeout=120,
            )
            body = r.json()
            return r.status_code, body["id"] if r.status_code == 201 else body["error"]["code"]

        with ThreadPoolExecutor(max_workers=20) as pool:
            results = list(pool.map(create, range(20)))
        assert Counter(s for s, _ in results) == {201: 10, 429: 10}, Counter(results)
        assert {code for s, code in results if s == 429} == {"quota.accelerators"}
        placed = {sid for s, sid in results if s == 201}

        tenant = MasterClient(replicas[0].url, key=key)
        rows = {sid: tenant.sandbox(sid) for sid in placed}
        paths = {sid: path_entries(r)[-1] for sid, r in rows.items()}
        warm_rows = {sid: p["warm_id"] for sid, p in paths.items() if p["path"] == "warm"}
        cold = [p for p in paths.values() if p["path"] == "cold"]
        # Every warm sandbox handed out exactly once, each to one create; the other creates went cold, saying why.
        # CubeMaster's claim rows already kept two creates off one warm sandbox: no claim reached the Cubelet
        # that its CAS had to refuse (that would be `warm.claim_failed`, with `warm_attempts`).
        assert sorted(warm_rows.values()) == sorted(warm), paths
        assert [p["reason"] for p in cold] == ["warm.pool_empty"] * 6, cold
        # The Cubelet's truth agrees: 4 claims, of 4 distinct warm sandboxes, under the warm creates' ids.
        handed = claimed_warm_ids(nodes[0])
        assert sorted(handed) == sorted(warm)
        holders = [d.sandbox_id for n in nodes for d in n.client.devices() if d.sandbox_id]
        assert sorted(holders) == sorted(placed)
        tenant.close()
    finally:
        for n in nodes:
            n.stop()


@pytest.mark.parametrize("claim_lands", [False, True], ids=["before-the-cubelet-took-it", "after"])
def test_a_replica_sigkilled_mid_claim_converges(
    replicas: list[MasterProcess], tmp_path: Path, claim_lands: bool
) -> None:
    """Replica A dies between its claim row and the Cubelet's answer: before the Cubelet read the claim (A's
    connection is gone when it wakes), or after the Cubelet's CAS took it (A stopped, then killed)."""
    a, b = replicas
    node = cubelet(tmp_path / "n", "4xh100", "n", b.url).start()  # heartbeats to the replica that survives
    assert node.proc is not None
    try:
        wait_nodes_ready(b.client, {"n"})
        b.client.register_template(TEMPLATE, default=True)
        warm = _frozen_pool(b, node, "n", 2)
        # A creates: its own view must hold the pool first (a replica reads heartbeats through its cache)
        poll(lambda: set(advertised(a, "n")[0].sandboxes) == warm if advertised(a, "n") else False, 30)

        # The Cubelet is stopped, so replica A's claim waits on it after A wrote its claim row; A dies there.
        os.kill(node.proc.pid, signal.SIGSTOP)
        outcome: list[Any] = []

        def create_on_a() -> None:
            try:
                outcome.append(a.client.create({"gpu": "H100:1", "id": "sb-k"}))
            except Exception as e:  # the replica is killed under it
                outcome.append(e)

        t = threading.Thread(target=create_on_a, daemon=True)
        try:
            t.start()
            poll(lambda: [e["path"] for e in path_entries(b.client.sandbox("sb-k"))] == ["warm"], 30)
            w = path_entries(b.client.sandbox("sb-k"))[0]["warm_id"]
            assert w in warm and b.client.sandbox("sb-k").state == "placing"
            assert a.proc is not None
            if claim_lands:
                port = int(node.extra[node.extra.index("--listen") + 1].rsplit(":", 1)[1])
                poll(lambda: request_waiting_on(port), 10)  # A's claim is in the Cubelet's socket
                a.proc.send_signal(signal.SIGSTOP)  # its connection stays open: the Cubelet reads and claims
                os.kill(node.proc.pid, signal.SIGCONT)
                poll(lambda: claimed_warm_ids(node) == [w], 30)
            a.proc.kill()
            a.proc.wait()
        finally:
            os.kill(node.proc.pid, signal.SIGCONT)
        t.join(30)

        # Replica B settles the abandoned placement by asking the Cubelet, whose journal decided the claim.
        poll(lambda: b.client.sandbox("sb-k").state in ("running", "failed"), 90)
        row = b.client.sandbox("sb-k")
        # Killed before the Cubelet answered, A's request may still sit whole in the Cubelet's socket, which reads
        # and claims it on waking (measured: some runs): either outcome converges, and the journal decides which.
        assert row.state in (("running",) if claim_lands else ("running", "failed")), row
        res = node.client.request("GET", "/v1/reservations")["reservations"]
        mine = [r for r in res if r["sandbox_id"] == "sb-k"]
        if row.state == "running":  # the claim reached the Cubelet: the sandbox is sb-k's, W is gone
            assert [r["facts"]["shim_id"] for r in mine] == [w]
            poll(lambda: w not in advertised(b, "n")[0].sandboxes, 30)
        else:  # it never did: W is still warm, its claim row is freed, and it is handed out again
            assert row.error is not None and row.error.code == "sandbox.placement_abandoned" and not mine
            poll(lambda: w in advertised(b, "n")[0].sandboxes and advertised(b, "n")[0].claimable == 2, 30)
        # Either way: no warm sandbox in two sandboxes, and the rest stay claimable, once each.
        left = warm - set(claimed_warm_ids(node))
        poll(lambda: advertised(b, "n")[0].claimable == len(left), 30)
        taken = []
        for i in range(len(left) + 1):
            got = b.client.create({"gpu": "H100:1", "id": f"sb-after-{i}"})
            taken.append(path_entries(got)[-1].get("warm_id"))
        assert sorted(x for x in taken if x) == sorted(left) and taken[-1] is None
        assert Counter(claimed_warm_ids(node)).most_common(1)[0][1] == 1
        assert sorted(claimed_warm_ids(node)) == sorted(warm)
    finally:
        node.stop()
