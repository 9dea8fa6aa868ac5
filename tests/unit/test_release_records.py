"""The release path's records (cubelet/release.py) encode as the dicts they replaced, byte for byte: the
`release_confirmed` evidence, a held device's details, the reset ladder's attempts (model/reset_ladder.py)."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from cubeaccel.backends.base import Problem
from cubeaccel.cubelet.release import Blocking, Hold, ReleaseEvidence
from cubeaccel.cubelet.scrub import ScrubPolicy
from cubeaccel.host.pci.base import Holder
from cubeaccel.model.reset_ladder import ResetAttempt, ResetStep, Rung

_TEXT = st.text(max_size=12)
_CODES = st.lists(_TEXT, max_size=3)
_STEPS = st.builds(
    ResetStep,
    rung=st.sampled_from(Rung),
    methods=st.tuples(_TEXT) | st.just(()),
    code=st.none() | _TEXT,
    reason=_TEXT,
    refused=st.tuples(_TEXT) | st.just(()),
)


def _old_attempt(step: ResetStep, check: list[str] | None) -> dict[str, object]:
    """backends/vfio.py's attempt dict, as it was built."""
    out: dict[str, object] = {"rung": step.rung.value, "reason": step.reason}
    if step.rung is Rung.QUARANTINE:
        out["code"] = step.code
    else:
        out["methods"] = list(step.methods)
        out["check"] = check or []
        out["ok"] = not check
    if step.refused:
        out["refused"] = list(step.refused)
    return out


@given(step=_STEPS, check=st.none() | _CODES)
def test_an_attempt_encodes_as_before(step: ResetStep, check: list[str] | None) -> None:
    new = ResetAttempt(step, None if check is None else tuple(check))
    assert json.dumps(new.to_json()) == json.dumps(_old_attempt(step, check))


@given(
    flags=st.tuples(*[st.booleans()] * 6),
    ladder=st.none() | st.lists(st.tuples(_STEPS, st.none() | _CODES), max_size=3),
    policy=st.sampled_from(ScrubPolicy),
    method=st.none() | _TEXT,
)
def test_the_release_evidence_encodes_as_before(
    flags: tuple[bool, ...],
    ladder: list[tuple[ResetStep, list[str] | None]] | None,
    policy: ScrubPolicy,
    method: str | None,
) -> None:
    shim_alive, final, detached, needs_vm, started, _ = flags
    old_ladder = None if ladder is None else [_old_attempt(s, c) for s, c in ladder]
    old: dict[str, Any] = {  # cubelet/release.py's `_judge_release`, as it was
        "vmm_exited": True,
        "shim_exited": not shim_alive,
        "shim_final_report": final,
        "detach_confirmed": detached,
        "holders": 0,
        "reset": True,
        **({"reset_ladder": old_ladder} if old_ladder is not None else {}),
        "scrub_owed": policy is ScrubPolicy.TRUSTED_VM and needs_vm and started,
        "scrub_policy": policy.value,
        "scrub_method": method,
        "vmm_started": started,
    }
    new = ReleaseEvidence(
        shim_exited=not shim_alive,
        shim_final_report=final,
        detach_confirmed=detached,
        reset_ladder=None
        if ladder is None
        else tuple(ResetAttempt(s, None if c is None else tuple(c)) for s, c in ladder),
        scrub_owed=policy is ScrubPolicy.TRUSTED_VM and needs_vm and started,
        scrub_policy=policy,
        scrub_method=method,
        vmm_started=started,
    )
    assert json.dumps(new.to_json()) == json.dumps(old)


@given(
    holders=st.lists(st.builds(Holder, st.integers(1, 1 << 22), _TEXT, _TEXT, st.booleans()), max_size=3),
    vmm_pid=st.none() | st.integers(1, 1 << 22),
    shim_alive=st.none() | st.booleans(),
    detached=st.booleans(),
)
def test_a_held_devices_details_encode_as_before(
    holders: list[Holder], vmm_pid: int | None, shim_alive: bool | None, detached: bool
) -> None:
    old = {
        "holders": [h.__dict__ for h in holders],
        "vmm_pid": vmm_pid,
        "shim_alive": shim_alive,
        "detach_confirmed": detached,
    }
    hold = Hold("release.holder_stuck", Blocking(tuple(holders), vmm_pid, shim_alive, detached))
    assert json.dumps(hold.details()) == json.dumps(old)


def test_the_other_holds_encode_as_before() -> None:
    assert Hold("release.vmm_state_unknown").details() is None
    problems = (Problem("vfio.node_not_returned", "still 1900000001's", hard=False),)
    assert Hold(problems[0].code, problems=problems).details() == {"problems": [p.__dict__ for p in problems]}
