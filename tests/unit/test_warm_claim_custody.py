"""A warm claim is a custody event (docs/warm.md): from the claim on, the Cubelet's hash-chained audit log says the
device is held by the tenant under the sandbox id the tenant sees, as a cold start's assignment says, and the
warm sandbox's own holding (no tenant) ends there. A real Cubelet and SQLite store on simulated devices."""

from __future__ import annotations

import time
from pathlib import Path

from cubeaccel.cubelet.lifecycle import ReservationRequest
from cubeaccel.host.service.audit import AuditLog, read, verify
from cubeaccel.model.audit_trail import holding_at
from cubeaccel.model.reservation_states import ReservationPhase
from tests.support.cubelet_harness import Node
from tests.support.poll import poll

SHAPE = ReservationRequest(count=1, template="t-1")


def _audited(dir: Path, path: Path) -> Node:
    """A node whose Cubelet was built with an audit log: every custody step is audited from its first event."""
    dir.mkdir()
    return Node.create(dir, "h100x8", audit=AuditLog(path))


def _one_warm(node: Node) -> str:
    warm = node.cubelet.warm
    warm.set_pool(SHAPE, 1)
    (sid,) = warm.refill_once()
    poll(lambda: (r := node.cubelet.store.reservation(sid)) is not None and r.phase is ReservationPhase.WARM, 20)
    warm.set_pool(SHAPE, 0)  # no refill: the one warm sandbox is the pool
    return sid


def test_a_claimed_warm_sandboxs_device_is_held_by_its_tenant_and_sandbox_id_from_the_claim(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    node = _audited(tmp_path / "node", path)
    warm_id = _one_warm(node)
    res = node.cubelet.store.reservation(warm_id)
    assert res is not None
    (dev,) = res.device_ids
    warm_held = holding_at(read(path), dev, time.time())["holder"]
    assert (warm_held["sandbox"], warm_held["tenant"]) == (warm_id, None)  # the node's own, no tenant's

    tenant_req = ReservationRequest(count=1, template="t-1", tenant="acme")
    claimed, _, _ = node.cubelet.warm.claim("sb-acme-1", tenant_req)
    assert claimed.device_ids == [dev]
    at = holding_at(read(path), dev, time.time())
    holder, previous = at["holder"], at["previous"]
    assert holder is not None and previous is not None
    assert (holder["sandbox"], holder["tenant"], holder["template"]) == ("sb-acme-1", "acme", "t-1")
    assert holder["contract_digest"] == warm_held["contract_digest"]
    assert (previous["sandbox"], previous["tenant"]) == (warm_id, None)
    assert previous["released_at"] == holder["assigned_at"]  # handed over at one instant: never nobody's, never two
    assert [e["action"] for e in holder["trail"]] == ["device:claimed"]
    claim_entry = holder["trail"][0]
    assert (claim_entry["warm_id"], claim_entry["device"]) == (warm_id, dev)

    node.cubelet.release("sb-acme-1")
    poll(lambda: node.cubelet.store.reservation("sb-acme-1") is None, 20)
    ended = holding_at(read(path), dev, time.time())
    assert ended["holder"] is None and ended["previous"]["tenant"] == "acme"
    assert "device:released" in [e["action"] for e in ended["previous"]["trail"]]
    assert verify(path) == []
