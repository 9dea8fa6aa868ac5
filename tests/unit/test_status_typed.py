"""The status the Cubelet pushes to CubeMaster is a `StatusBody` end to end: its JSON is what the dict it replaced
encoded to, byte for byte."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from cubeaccel.cubelet.ended import status_error
from cubeaccel.model.checkpoint import SandboxFailure
from cubeaccel.wire.master_api import StatusBody


def _old_body(status: dict[str, object]) -> str:
    """What `StatusPush` sent for the dict the lifecycle used to build."""
    return json.dumps(StatusBody.model_validate(status).model_dump(mode="json"))


def _new_body(status: StatusBody) -> str:
    return json.dumps(status.model_dump(mode="json"))


def test_running_encodes_as_before() -> None:
    assert _new_body(StatusBody(phase="running")) == _old_body({"phase": "running"})


@given(
    code=st.text(min_size=1, max_size=200),
    layer=st.text(min_size=1, max_size=64),
    message=st.text(max_size=500),
    phase=st.text(max_size=32),
)
def test_a_failure_encodes_as_before(code: str, layer: str, message: str, phase: str) -> None:
    failure = SandboxFailure(code, layer, message, phase)
    old = _old_body({"phase": "failed", "error": failure.to_json()})
    assert _new_body(StatusBody(phase="failed", error=status_error(failure))) == old
