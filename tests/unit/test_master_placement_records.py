"""A create's timeline details, placement attempts and sandbox errors are typed records that write the JSON the
dict-based code wrote, key order included (it reaches the stored timeline, the API's records and error details)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

from hypothesis import given
from hypothesis import strategies as st

from cubeaccel.master.scheduler import Candidate
from cubeaccel.master.service import START_FAILED, sandbox_error
from cubeaccel.master.store import MasterStore
from cubeaccel.master.view import Group, NodeView
from cubeaccel.master.warm import claim_phases
from cubeaccel.model.sandbox_states import SandboxActor, SandboxEvent
from cubeaccel.wire import master_api as W
from cubeaccel.wire.base import Record
from cubeaccel.wire.cubelet_api import Failure, ReservationView, TimelineEntry, WarmHandOff
from cubeaccel.wire.sandbox_timeline import (
    AbandonedDelete,
    ColdPath,
    Recovered,
    ReserveAttempt,
    Reserved,
    Scheduled,
    TimeoutSet,
    WarmAttempt,
    WarmPath,
)
from tests.support.master_builders import sandbox_row
from tests.support.stored_rows import text

ms = st.floats(0, 1e6, allow_nan=False)
maybe_ms = st.none() | ms


def js(model: Record) -> Any:
    return model.model_dump(mode="json")


def same(new: Any, old: Any) -> None:
    """Equal as JSON text: the same keys, in the same order, with the same values."""
    assert json.dumps(new) == json.dumps(old)


@given(node=text, code=text, message=text, warm_id=text, reason=st.none() | text)
def test_attempts_are_the_dicts_they_were(node: str, code: str, message: str, warm_id: str, reason: str | None) -> None:
    same(js(ReserveAttempt(node=node, code=code, message=message)), {"node": node, "code": code, "message": message})
    old = {"node": node, "warm_id": warm_id, "code": code, "reason": reason, "message": message}
    same(js(WarmAttempt(node=node, warm_id=warm_id, code=code, reason=reason, message=message)), old)


@given(node=text, decision_ms=ms, labels=st.dictionaries(text, text, max_size=3), score=st.lists(ms, max_size=3))
def test_a_scheduled_entry_is_the_candidate_after_node_and_decision_time(
    node: str, decision_ms: float, labels: dict[str, str], score: list[float]
) -> None:
    cand = Candidate(
        cast(NodeView, SimpleNamespace(name=node)), cast(Group, SimpleNamespace(labels=labels)), tuple(score)
    )
    new = Scheduled(node=node, decision_ms=decision_ms, group=dict(cand.group.labels), score=list(cand.score))
    same(js(new), {"node": node, "decision_ms": decision_ms, **cand.to_json()})


@given(reason=text, n=st.integers(0, 3), refilling=st.none() | st.integers(0, 9))
def test_the_cold_path_entry_names_only_what_it_has(reason: str, n: int, refilling: int | None) -> None:
    tried = [
        WarmAttempt(node=f"n{i}", warm_id=f"w{i}", code="warm.no_match", reason=None, message="m") for i in range(n)
    ]
    old: dict[str, Any] = {"path": "cold", "reason": reason}
    if tried:
        old["warm_attempts"] = [js(t) for t in tried]
    if refilling is not None:
        old["refilling"] = refilling
    same(js(ColdPath.of(reason, tried, refilling)), old)


def test_the_small_entries_are_the_dicts_they_were() -> None:
    same(
        js(WarmPath(node="n1", warm_id="w1", pool="pool")),
        {"path": "warm", "node": "n1", "warm_id": "w1", "pool": "pool"},
    )
    same(js(Recovered(node="n1")), {"node": "n1", "recovered": True})
    same(js(AbandonedDelete(abandoned_in="placing")), {"abandoned_in": "placing"})
    same(js(TimeoutSet(timeout_s=30.0)), {"timeout_s": 30.0})


def old_claim_phases(requested_at: float, sent_at: float, answered_at: float, reply: ReservationView) -> dict[str, Any]:
    cas_at = next((e.at for e in reply.timeline if e.kind == "warm_claimed"), None)
    hand = reply.hand_off
    out: dict[str, Any] = {
        "master_ms": round((sent_at - requested_at) * 1000, 1),
        "claim_ms": round((answered_at - sent_at) * 1000, 1),
        "cas_ms": None if cas_at is None else round((cas_at - sent_at) * 1000, 1),
        "reseed_ms": None if hand is None else hand.reseed_ms,
        "rebind_ms": None if hand is None else hand.rebind_ms,
    }
    known = [v for k, v in out.items() if k in ("cas_ms", "reseed_ms", "rebind_ms") and v is not None]
    out["claim_other_ms"] = round(out["claim_ms"] - sum(known), 1)
    return out


step = st.builds(
    TimelineEntry,
    at=st.floats(1.7e9, 1.8e9),
    kind=st.sampled_from(["warm_claimed", "reserved", "started"]),
    event=st.none() | text,
    device_id=st.none() | text,
    to_state=st.none() | text,
)
hand_off = st.none() | st.builds(WarmHandOff, reseed_ms=maybe_ms, rebind_ms=maybe_ms, reseeded=st.booleans())


@given(
    at=st.floats(1.7e9, 1.8e9),
    waits=st.tuples(ms, ms),
    steps=st.lists(step, max_size=25),
    hand=hand_off,
    claim_ms=ms,
    warm=st.booleans(),
)
def test_a_reserved_entry_and_a_warm_claims_phases_are_what_they_were(
    at: float,
    waits: tuple[float, float],
    steps: list[TimelineEntry],
    hand: WarmHandOff | None,
    claim_ms: float,
    warm: bool,
) -> None:
    reply = ReservationView.model_construct(timeline=steps, hand_off=hand)
    sent, answered = at + waits[0] / 1000, at + (waits[0] + waits[1]) / 1000
    phases = claim_phases(at, sent, answered, reply)
    same(js(phases), old_claim_phases(at, sent, answered, reply))
    kept = [e.model_dump(mode="json") for e in reply.timeline[-20:]]
    if warm:
        old = {"node": "n1", "path": "warm", "claim_ms": claim_ms, "phases": js(phases), "cubelet_timeline": kept}
        steps_kept = reply.timeline[-20:]
        new = Reserved(node="n1", path="warm", claim_ms=claim_ms, phases=phases, cubelet_timeline=steps_kept)
    else:
        old, new = {"node": "n1", "cubelet_timeline": kept}, Reserved(node="n1", cubelet_timeline=reply.timeline[-20:])
    same(js(new), old)


failures = st.builds(Failure, code=text, layer=text, message=text, phase=text)
status_errors = st.builds(
    W.StatusError, code=text.filter(bool), layer=text.filter(bool), message=text, phase=st.none() | text
)


@given(failure=failures, status=status_errors, node=text)
def test_a_sandbox_error_is_the_cubelets_failure_with_its_node(
    failure: Failure, status: W.StatusError, node: str
) -> None:
    on = {"node": node}
    same(
        sandbox_error(failure).model_copy(update=on).model_dump(mode="json"), {**failure.model_dump(mode="json"), **on}
    )
    same(sandbox_error(status).model_copy(update=on).model_dump(mode="json"), {**status.model_dump(), **on})
    old_start_failed = {
        "code": "sandbox.start_failed",
        "layer": "cubelet",
        "message": "the reservation closed during start",
    }
    same(START_FAILED.model_copy(update=on).model_dump(mode="json"), {**old_start_failed, **on})
    same(W.SandboxError().model_copy(update=on).model_dump(mode="json"), on)  # a failed push that named no error


def test_the_stored_timeline_entry_and_error_are_the_json_the_dict_based_store_wrote(tmp_path: Path) -> None:
    store = MasterStore(str(tmp_path / "m.db"))
    store.insert_sandbox(sandbox_row("sb-1", time.time()))
    tried = [WarmAttempt(node="n1", warm_id="w1", code="warm.no_match", reason="gone", message="m")]
    detail: Record = ColdPath.of("no_pool", tried, 2)
    error = W.SandboxError(code="cubelet.unreachable", message="timed out")
    assert store.update_sandbox(
        "sb-1", "path", detail=detail, event=SandboxEvent.DELETE, by=SandboxActor.USER, error=error
    )
    with store.tx() as c:
        timeline, stored_error = c.exec_driver_sql("SELECT timeline, error FROM sandboxes WHERE id = 'sb-1'").one()
    at = json.loads(timeline)[-1]["at"]
    assert timeline == json.dumps([{"at": at, "phase": "path", **js(detail)}])
    assert stored_error == json.dumps({"code": "cubelet.unreachable", "message": "timed out"})
    store.close()
