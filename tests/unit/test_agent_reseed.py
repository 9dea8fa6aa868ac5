"""cube-agent's `reseed` (a warm claim's RNG seed into the guest kernel) and the warm shim's control socket that
calls it before the rebind: the ack says `reseeded` only when the guest confirmed."""

from __future__ import annotations

import json
import os
import secrets
import socket
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cubeaccel.agent.probes import ProbeContext
from cubeaccel.agent.protocol import Agent
from cubeaccel.shim.warm_control import WarmControl
from cubeaccel.wire.warm import ShimClaim, ShimClaimAck


def _call(agent: Agent, params: dict[str, Any]) -> dict[str, Any]:
    reply = agent.handle_line(json.dumps({"v": 1, "id": 1, "method": "reseed", "params": params}).encode())
    assert reply is not None
    return reply


def test_the_seed_is_written_to_the_guests_urandom_and_not_credited_when_it_is_not_the_kernel(tmp_path: Path) -> None:
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev/urandom").write_bytes(b"")
    seed = secrets.token_bytes(32)
    reply = _call(Agent(ctx=ProbeContext(root=tmp_path)), {"seed": seed.hex()})
    assert reply["ok"] is True, reply
    assert (tmp_path / "dev/urandom").read_bytes() == seed
    assert reply["result"] == {
        "mixed": True,
        "credited_bits": 0,
        "crng_reseeded": False,
        "why_not": "not a character device",
    }


def test_the_real_urandom_takes_the_seed_and_credits_it_only_where_the_kernel_allows() -> None:
    reply = _call(Agent(), {"seed": secrets.token_hex(32)})
    result = reply["result"]
    assert result["mixed"] is True
    if os.geteuid() != 0:
        assert result["credited_bits"] == 0 and result["why_not"] == "not root: mixed, not credited"
    else:  # root in the guest; a container's root may lack CAP_SYS_ADMIN, and then it says so
        assert (result["credited_bits"], result["crng_reseeded"]) == (256, True) or "ioctl" in result["why_not"]


@given(st.one_of(st.text(max_size=80), st.integers(), st.none(), st.lists(st.integers(0, 255), max_size=40)))
def test_a_seed_that_is_not_32_bytes_of_lower_case_hex_is_refused(seed: object) -> None:
    if isinstance(seed, str) and len(seed) == 64 and all(c in "0123456789abcdef" for c in seed):
        return
    reply = _call(Agent(ctx=ProbeContext(root=Path("/nonexistent"))), {"seed": seed})
    assert reply["ok"] is False and reply["error"]["code"] == "agent.invalid_params"


def test_a_guest_without_urandom_says_the_reseed_failed(tmp_path: Path) -> None:
    reply = _call(Agent(ctx=ProbeContext(root=tmp_path)), {"seed": "ab" * 32})
    assert reply["ok"] is False and reply["error"]["code"] == "agent.reseed_failed"


class Bridge:
    def __init__(self) -> None:
        self.tokens: list[str] = []

    def rebind(self, token: str, timeout_s: float) -> None:
        self.tokens.append(token)


def _claim(control: WarmControl) -> ShimClaimAck:
    msg = ShimClaim(sandbox_id="t-1", workload_token="k" * 43, rng_seed="cd" * 32)  # type: ignore[arg-type]
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(10)
        s.connect(str(control.path))
        s.sendall(msg.line())
        raw = s.makefile("rb").readline()
    return ShimClaimAck.model_validate_json(raw)


@pytest.mark.parametrize(
    ("guest", "reseeded"),
    [("confirms", True), ("refuses", False), ("raises", False)],
)
def test_the_claim_reseeds_before_the_rebind_and_the_ack_says_whether_the_guest_confirmed(
    tmp_path: Path, guest: str, reseeded: bool
) -> None:
    bridge, order = Bridge(), []

    def reseed(seed: str) -> bool:
        order.append(("reseed", seed, list(bridge.tokens)))
        if guest == "raises":
            raise OSError("agent channel closed")
        return guest == "confirms"

    control = WarmControl(tmp_path, bridge, lambda c: None, reseed)  # type: ignore[arg-type]
    control.start()
    try:
        ack = _claim(control)
    finally:
        control.close()
    assert ack.ok is True and ack.reseeded is reseeded
    assert order == [("reseed", "cd" * 32, [])]  # the seed went in while the tenant's token had not
    assert bridge.tokens == ["k" * 43]
