"""A node drain through CubeMaster removes the node's warm sandboxes first, through the release path, and stops
their refill; a tenant's sandbox on the node is left running; undrain refills (docs/warm.md). Real CubeMaster and
Cubelet processes over HTTP, simulated devices."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from cubeaccel.model.contract import freeze
from cubeaccel.protocol.errors import CubeError
from cubeaccel.wire.master_api import NodeVerbReply
from cubeaccel.wire.templates import parse_template
from cubeaccel.wire.warm import WarmDrainReply
from tests.support.cubelet_process import CubeletProcess
from tests.support.master_harness import Cluster, example
from tests.support.poll import poll

PROFILES = {"w1": "4xh100"}


def _pool(p: CubeletProcess) -> dict[str, Any]:
    reply = p.client.request("GET", "/v1/warm/pools")
    (pool,) = reply["pools"]
    return {**pool, "draining": reply["draining"]}


def _rows(p: CubeletProcess) -> list[dict[str, Any]]:
    return list(p.client.request("GET", "/v1/reservations")["reservations"])


def _warm_ids(p: CubeletProcess) -> set[str]:
    return {r["sandbox_id"] for r in _rows(p) if r["sandbox_id"].startswith("warm-")}


def _warm(reply: NodeVerbReply) -> WarmDrainReply:
    """The node's own drain reply, which CubeMaster passes on when it reached the Cubelet."""
    assert isinstance(reply.warm, WarmDrainReply), reply.warm
    return reply.warm


def _teardown_reasons(p: CubeletProcess, sid: str) -> list[str | None]:
    events = p.client.events(0, 10000).events
    return [e.reason for e in events if e.sandbox_id == sid and e.kind == "teardown_started"]


def test_a_drain_tears_down_the_warm_sandboxes_first_and_stops_the_refill_and_undrain_refills(c: Cluster) -> None:
    node = c.cubelets["w1"]
    doc = example("cuda12-h100", spec__memory__size_mib=1024)
    shape = {"contract": freeze(parse_template(doc)).to_json(), "template": "cuda12-h100", "class": "gpu"}
    node.client.request("PUT", "/v1/warm/pools", {**shape, "memory_mib": 1024, "size": 2})
    poll(lambda: _pool(node)["warm"] == 2, 60, what="two warm sandboxes")
    tenant = c.c.create({"gpu": "H100:1"})  # warm or cold, as CubeMaster finds the pool: a tenant's either way
    assert tenant.node == "w1"
    poll(lambda: _pool(node)["warm"] == 2 and _pool(node)["starting"] == 0, 60, what="the pool full again")
    warm = _warm_ids(node)

    reply = c.c.node_verb("w1", "drain", "alice", "kernel update")
    assert reply.model_dump()["state"] == "draining"
    assert _warm(reply).draining is True and set(_warm(reply).torn_down) == warm
    for sid in warm:
        assert _teardown_reasons(node, sid) == ["warm.drained"]
    poll(lambda: not _warm_ids(node), 60, what="the warm reservations closed (VMMs gone)")
    poll(lambda: sum(d.state == "allocatable" for d in node.client.devices()) == 3, 60)
    assert [r["phase"] for r in _rows(node)] == ["running"]  # the tenant's, untouched

    # Drained: no refill (it runs every second and would have replaced them while they were releasing), and a
    # claim of the pool's shape misses saying why.
    assert _pool(node)["draining"] is True and _pool(node)["starting"] == 0 and not _warm_ids(node)
    with pytest.raises(CubeError) as miss:
        node.client.request("POST", "/v1/warm/claim", {**shape, "memory_mib": 1024, "sandbox_id": "late"})
    assert miss.value.details["reason"] == "warm.drained"
    assert _pool(node)["failures"] == 0  # ending warm starts is not the pool failing
    journal = {e.sandbox_id for e in node.client.events(0, 10000).events if e.sandbox_id}
    # None started since the drain; the tenant's own shim keeps the warm id its create claimed, if it went warm.
    claimed = {(r.get("facts") or {}).get("shim_id") for r in _rows(node) if r["sandbox_id"] == tenant.id}
    assert {sid for sid in journal if sid.startswith("warm-")} - claimed == warm

    back = c.c.node_verb("w1", "undrain", "alice")
    assert back.model_dump()["state"] == "ready" and back.warm == WarmDrainReply(draining=False, torn_down=[])
    poll(lambda: _pool(node)["warm"] == 2, 60, what="the pool refilled after undrain")
    c.c.delete(tenant.id)
    node.client.request("PUT", "/v1/warm/pools", {**shape, "memory_mib": 1024, "size": 0})
    for sid in _warm_ids(node):
        node.client.release(sid)
    poll(lambda: not _rows(node), 60)


REFILL_PERIOD_S = 1.0


def _holds(fn: Callable[[], bool], periods: int, what: str) -> None:
    """`fn` stays true over `periods` refill periods (the refill wakes every second): a negative's check."""
    end = time.monotonic() + periods * REFILL_PERIOD_S
    while time.monotonic() < end:
        assert fn(), what
        time.sleep(0.1)


def test_a_drain_outlives_a_cubelet_restart_and_so_does_the_undrain(c: Cluster) -> None:
    node = c.cubelets["w1"]
    doc = example("cuda12-h100", spec__memory__size_mib=1024)
    shape = {"contract": freeze(parse_template(doc)).to_json(), "template": "cuda12-h100", "class": "gpu"}
    node.client.request("PUT", "/v1/warm/pools", {**shape, "memory_mib": 1024, "size": 2})
    poll(lambda: _pool(node)["warm"] == 2, 60, what="two warm sandboxes")
    warm = _warm_ids(node)
    assert set(_warm(c.c.node_verb("w1", "drain", "alice", "kernel update")).torn_down) == warm
    poll(lambda: not _warm_ids(node), 60, what="the warm sandboxes released")

    node.sigkill()  # a crash: nothing is written on the way out
    node.start()
    # The journal kept the pool and the drain: the pool is there, drained, and neither refills nor hands out.
    pool = _pool(node)
    assert pool["draining"] is True and pool["size"] == 2, pool
    with pytest.raises(CubeError) as miss:
        node.client.request("POST", "/v1/warm/claim", {**shape, "memory_mib": 1024, "sandbox_id": "late"})
    assert miss.value.details["reason"] == "warm.drained"
    _holds(lambda: _pool(node)["starting"] == 0 and not _warm_ids(node), 3, "a drained node refilled")

    assert _warm(c.c.node_verb("w1", "undrain", "alice")).draining is False
    poll(lambda: _pool(node)["warm"] == 2, 60, what="the pool refilled after undrain")
    node.sigkill()
    node.start()
    pool = _pool(node)
    assert pool["draining"] is False and pool["warm"] == 2, pool  # undrained it stays, its warm ones kept
    node.client.request("PUT", "/v1/warm/pools", {**shape, "memory_mib": 1024, "size": 0})
    for sid in _warm_ids(node):
        node.client.release(sid)
    poll(lambda: not _rows(node), 60)


def test_a_drain_the_cubelet_did_not_keep_is_sent_again_by_cubemaster(c: Cluster) -> None:
    """CubeMaster says draining, the node's warm pools do not (the drain's call never arrived, or the Cubelet was
    started with `--warm-reset`, as `up` does): CubeMaster's maintenance drains them again from the heartbeat."""
    node = c.cubelets["w1"]
    cursor = max((e.seq for e in node.client.events(0, 10000).events), default=0)
    doc = example("cuda12-h100", spec__memory__size_mib=1024)
    shape = {"contract": freeze(parse_template(doc)).to_json(), "template": "cuda12-h100", "class": "gpu"}
    node.client.request("PUT", "/v1/warm/pools", {**shape, "memory_mib": 1024, "size": 1})
    poll(lambda: _pool(node)["warm"] == 1, 60, what="a warm sandbox")
    assert _warm(c.c.node_verb("w1", "drain", "alice", "kernel update")).draining is True
    poll(lambda: not _warm_ids(node), 60, what="the warm sandbox released")

    node.client.request("POST", "/v1/warm/undrain")  # the Cubelet alone forgets the drain
    poll(lambda: _pool(node)["draining"], 30, what="CubeMaster's drain sent again")
    poll(lambda: not _warm_ids(node) and _pool(node)["starting"] == 0, 60, what="no warm sandbox left")
    drains = [e for e in node.client.events(cursor, 10000).events if e.kind == "warm_drained"]
    assert len(drains) == 2, drains  # the operator's, then CubeMaster's once (not one per maintenance tick)

    node.client.request("PUT", "/v1/warm/pools", {**shape, "memory_mib": 1024, "size": 0})  # no refill after
    assert _warm(c.c.node_verb("w1", "undrain", "alice")).draining is False
    for sid in _warm_ids(node):
        node.client.release(sid)
    poll(lambda: not _rows(node), 60)
