"""One Connect envelope codec (`protocol/connect_envelope.py`, issue 31): the guest's workload service, the host's
workload client, the Cubelet's proxy and the front door read and write the same bytes, however a stream is cut."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cubeaccel.cubelet.api.workload import _end_of_stream_error, _EnvelopeTracker
from cubeaccel.frontdoor.envd import inject_envs
from cubeaccel.protocol import connect_envelope as ce
from cubeaccel.protocol.errors import CubeError
from cubeaccel.transport.workload_client import envelope, envelopes
from cubeaccel.workload import connect as guest

messages = st.dictionaries(st.text(max_size=8), st.integers() | st.text(max_size=20), max_size=4)


def pieces(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({x % (len(data) + 1) for x in cuts} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(points)]


@given(st.lists(messages, max_size=6), st.lists(st.integers(0, 2000), max_size=8))
def test_every_party_reads_the_same_stream_however_it_is_cut(msgs: list[dict[str, object]], cuts: list[int]) -> None:
    wire = b"".join(guest.encode_envelope(m) for m in msgs) + guest.end_stream()
    assert wire == b"".join(envelope(m) for m in msgs) + envelope({}, ce.FLAG_END_STREAM)  # host writes the same
    host = list(envelopes(pieces(wire, cuts)))
    assert [m for _, m in host[:-1]] == msgs and host[-1][0] == ce.FLAG_END_STREAM
    decoder, tracker = guest.EnvelopeDecoder(), _EnvelopeTracker()
    seen: list[guest.Envelope] = []
    for piece in pieces(wire, cuts):
        seen += decoder.feed(piece)
        tracker.feed(piece)
    decoder.finish()
    assert [e.message() for e in seen[:-1]] == msgs
    assert tracker.ended and not tracker.at_boundary  # the proxy saw the end of the stream


def test_each_party_refuses_an_oversized_length_and_a_cut_envelope_in_its_own_terms() -> None:
    big = ce.HEADER.pack(0, 1 << 30)
    with pytest.raises(ce.EnvelopeError) as raw:
        ce.EnvelopeDecoder(1024).feed(big)
    assert raw.value.kind == "too_large"
    with pytest.raises(guest.ConnectError) as g:
        guest.EnvelopeDecoder().feed(big)
    assert g.value.code == "resource_exhausted"
    with pytest.raises(CubeError) as h:
        list(envelopes([envelope({"a": 1})[:-1]]))
    assert h.value.code == "workload.bad_reply"


def test_the_front_door_rewrites_one_envelope_and_leaves_anything_else_to_the_guest() -> None:
    one = envelope({"process": {"cmd": "env"}})
    out = ce.single(inject_envs(one, {"K": "v"}, streaming=True))
    assert out is not None and json.loads(out.payload) == {"process": {"cmd": "env", "envs": {"K": "v"}}}
    two = one + one
    assert inject_envs(two, {"K": "v"}, streaming=True) == two
    assert ce.single(b"\x00\x00") is None


def test_the_proxys_error_envelope_ends_the_stream() -> None:
    (env,) = guest.EnvelopeDecoder().feed(_end_of_stream_error("unavailable", "the sandbox went away"))
    assert env.flags == ce.FLAG_END_STREAM
    assert env.message() == {"error": {"code": "unavailable", "message": "the sandbox went away"}}
