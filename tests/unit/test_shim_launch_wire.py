"""The fork server's request (issue 18, deliverable 6) is a wire format Cubelet writes and a root process reads:
whatever bytes arrive, it is refused as a ValidationError or accepted only in the one shape the server forks."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from cubeaccel.wire.shim_launch import SHIM_ARGV_PREFIX, ShimLaunchReply, ShimLaunchRequest

GOOD = {"argv": ["/usr/bin/python3", *SHIM_ARGV_PREFIX, "--sandbox", "a", "--spec", "/s/a.json"], "env": {}, "cwd": "/"}
text = st.text(max_size=20)
values = st.recursive(st.none() | st.booleans() | st.integers() | text, lambda c: st.lists(c, max_size=4), max_leaves=8)


@given(st.dictionaries(st.sampled_from(["argv", "env", "cwd", "workload_token", "v", "extra"]), values, max_size=6))
def test_any_json_object_is_refused_or_is_a_shim_run(body: dict[str, object]) -> None:
    try:
        req = ShimLaunchRequest.model_validate_json(json.dumps(body))
    except ValidationError:
        return
    assert req.argv[1:4] == SHIM_ARGV_PREFIX and all(a and "\0" not in a for a in req.argv)
    assert req.cwd.startswith("/")


@given(st.binary(max_size=200))
def test_any_bytes_are_refused_without_another_exception(raw: bytes) -> None:
    with pytest.raises(ValidationError):
        ShimLaunchRequest.model_validate_json(raw)


@pytest.mark.parametrize(
    "change",
    [
        {"argv": ["/usr/bin/python3", "-c", "import os; os.system('id')"]},  # not the shim's command
        {"argv": ["/usr/bin/python3", *SHIM_ARGV_PREFIX, "--sandbox", "a\0b"]},
        {"argv": ["/usr/bin/python3", *SHIM_ARGV_PREFIX, ""]},
        {"cwd": "relative/dir"},
        {"env": {"K": 1}},
        {"v": 2},
        {"shell": True},
    ],
)
def test_a_request_outside_the_shape_is_refused(change: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        ShimLaunchRequest.model_validate({**GOOD, **change})


def test_the_token_is_secret_in_the_model_and_the_reply_names_a_pid_or_an_error() -> None:
    req = ShimLaunchRequest.model_validate({**GOOD, "workload_token": "s3cret"})
    assert "s3cret" not in repr(req) and req.workload_token is not None
    assert req.workload_token.get_secret_value() == "s3cret"
    assert ShimLaunchReply.model_validate_json('{"pid": 4242}').pid == 4242
    with pytest.raises(ValidationError):
        ShimLaunchReply.model_validate_json('{"pid": 1}')  # init is never a forked shim
