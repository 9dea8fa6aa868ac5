"""Which advertised warm sandboxes a create may claim (docs/warm.md): the pool's shape must be the one the
Cubelet would record for the request (contract digest, device class and count, memory, vCPUs, pinning, the
effective network policy), and the node must pass the node-level filters cold placement applies first (fresh,
not draining, host ready) and the request's model and selector over the warm sandbox's device group.

Pure over node views: the claim itself (claim row, quota, the Cubelet's CAS) is the service's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cubeaccel.master.selector import Selector
from cubeaccel.master.view import NodeView, device_attributes, group_key
from cubeaccel.model.contract import CompatibilityContract
from cubeaccel.model.event_kinds import EventKind
from cubeaccel.model.request import AcceleratorChoice
from cubeaccel.model.sandbox_states import NodeState
from cubeaccel.wire.cubelet_api import ReservationView
from cubeaccel.wire.master_api import WarmSandbox
from cubeaccel.wire.sandbox_timeline import ClaimPhases
from cubeaccel.wire.warm import WarmPoolFact

WARM_STATE = "warm"  # how CubeMaster lists a node's warm sandbox (`GET /v1/sandboxes?state=warm`)

# Miss reasons (error catalog): why a create took the cold path.
NO_POOL = "warm.no_pool"  # no eligible node keeps a pool of the request's shape (and devices)
POOL_EMPTY = "warm.pool_empty"  # pools of that shape exist, none has a warm sandbox no other create holds
CLAIM_FAILED = "warm.claim_failed"  # a claim was tried and did not hand a sandbox over (the Cubelet said why)


Alternative = tuple[AcceleratorChoice, CompatibilityContract, Selector | None]


@dataclass(frozen=True)
class WarmAsk:
    """A create's shape as a warm pool must match it: its resolved alternatives, the memory it names (None: the
    template's), its vCPUs and its effective network policy."""

    resolved: Sequence[Alternative]
    memory_mib: int | None
    vcpus: int
    network: dict[str, Any] | None


@dataclass(frozen=True)
class WarmCandidate:
    node: NodeView
    pool: WarmPoolFact
    choice: AcceleratorChoice
    contract: CompatibilityContract
    warm_ids: tuple[str, ...]  # free (no claim row) and passing the request's labels, oldest first
    group_key: str
    labels: dict[str, str]


def pool_matches(
    pool: WarmPoolFact,
    choice: AcceleratorChoice,
    contract: CompatibilityContract,
    memory_mib: int,
    vcpus: int,
    network: dict[str, Any] | None,
) -> bool:
    return (
        pool.contract_digest == contract.digest
        and pool.accel_class == choice.accel_class
        and pool.count == choice.count
        and pool.memory_mib == memory_mib
        and pool.vcpus == vcpus
        and pool.pin_memory == contract.pin_memory
        and (pool.network or None) == (network or None)
    )


def node_eligible(n: NodeView, now: float, staleness_s: float) -> bool:
    """The node-level filters of cold placement (`node_stale`, `node_draining`, `host_not_ready`)."""
    return n.state == NodeState.READY and n.host_ready and not n.stale(now, staleness_s)


def candidates(
    views: Sequence[NodeView], ask: WarmAsk, now: float, staleness_s: float
) -> tuple[list[WarmCandidate], str]:
    """Claimable warm sandboxes for the request, best first (the first alternative first, then the node with
    the most free warm ones), and the miss reason when there are none."""
    out: list[WarmCandidate] = []
    shaped = False
    for alternative in ask.resolved:
        choice, contract, selector = alternative
        here: list[WarmCandidate] = []
        for n, pool in _matching(views, ask, alternative, now, staleness_s):
            fitting = [w for w in pool.sandboxes if _labels_ok(choice, selector, w.labels)]
            shaped = shaped or bool(fitting) or not pool.sandboxes  # an empty pool's labels are unknown
            free = set(n.warm_free(pool))
            by_group: dict[str, list[str]] = {}
            labels_of: dict[str, dict[str, str]] = {}
            for w in fitting:
                if w.id not in free:
                    continue
                key = group_key(choice.accel_class, w.labels)
                by_group.setdefault(key, []).append(w.id)
                labels_of[key] = dict(w.labels)
            for key, ids in by_group.items():
                here.append(WarmCandidate(n, pool, choice, contract, tuple(ids), key, labels_of[key]))
        here.sort(key=lambda c: (-len(c.warm_ids), c.node.name))
        out.extend(here)
    return out, ("" if out else POOL_EMPTY if shaped else NO_POOL)


def refilling(views: Sequence[NodeView], ask: WarmAsk, now: float, staleness_s: float) -> int:
    """Warm starts in flight in the pools a create matched (`starting`): a create that found them all taken
    goes cold without waiting for one (docs/decisions.md); its timeline says how many were on the way."""
    return sum(
        pool.starting
        for alternative in ask.resolved
        for _, pool in _matching(views, ask, alternative, now, staleness_s)
    )


def _matching(
    views: Sequence[NodeView], ask: WarmAsk, alternative: Alternative, now: float, staleness_s: float
) -> list[tuple[NodeView, WarmPoolFact]]:
    """The eligible nodes' pools of exactly the request's shape (labels aside: those are per warm sandbox)."""
    choice, contract, _ = alternative
    mem = ask.memory_mib or contract.memory_mib
    return [
        (n, pool)
        for n in views
        if node_eligible(n, now, staleness_s)
        for pool in n.warm_pools
        if pool_matches(pool, choice, contract, mem, ask.vcpus, ask.network)
    ]


def _labels_ok(choice: AcceleratorChoice, selector: Selector | None, labels: dict[str, str]) -> bool:
    if not choice.model_matches(labels.get("model", "")):
        return False
    return selector is None or selector.matches(device_attributes(choice.accel_class, labels))


def warm_rows(views: Sequence[NodeView]) -> list[WarmSandbox]:
    """The advertised warm sandboxes as sandbox records in state `warm`: owned by their node (tenant ""), no
    request, no timeline; `claimed` says whether a create holds its claim row now."""
    return [
        WarmSandbox.model_validate(
            {
                "id": w.id,
                "tenant": "",
                "state": WARM_STATE,
                "node": v.name,
                "class": p.accel_class,
                "count": p.count,
                "device_ids": [],
                "template": {"name": p.template, "version": None, "digest": p.contract_digest},
                "request": None,
                "error": None,
                "timeline": [],
                "expires_at": None,
                "created_at": v.received_at,
                "updated_at": v.received_at,
                "pool": p.key,
                "labels": dict(w.labels),
                "claimed": w.id in v.warm_claimed,
            }
        )
        for v in sorted(views, key=lambda v: v.name)
        for p in v.warm_pools
        for w in p.sandboxes
    ]


def claim_phases(requested_at: float, sent_at: float, answered_at: float, reply: ReservationView) -> ClaimPhases:
    """A warm create's phases in ms, for its timeline (issue 28: which path, and where its time went): CubeMaster
    before the claim (match, claim row), the Cubelet until its journal CAS committed, the shim's RNG reseed and
    rebind, and the rest of the claim's round trip (ack recorded, reply). Times are this host's and the node's
    wall clocks: a phase across them is only as good as their agreement."""
    cas_at = next((e.at for e in reply.timeline if e.kind == EventKind.WARM_CLAIMED), None)
    hand = reply.hand_off
    claim_ms = round((answered_at - sent_at) * 1000, 1)
    cas_ms = None if cas_at is None else round((cas_at - sent_at) * 1000, 1)
    reseed_ms = None if hand is None else hand.reseed_ms
    rebind_ms = None if hand is None else hand.rebind_ms
    known = [v for v in (cas_ms, reseed_ms, rebind_ms) if v is not None]
    return ClaimPhases(
        master_ms=round((sent_at - requested_at) * 1000, 1),
        claim_ms=claim_ms,
        cas_ms=cas_ms,
        reseed_ms=reseed_ms,
        rebind_ms=rebind_ms,
        claim_other_ms=round(claim_ms - sum(known), 1),
    )
