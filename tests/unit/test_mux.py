"""The virtio-serial multiplexing framing (protocol/mux.py): codec and the session state machine both ends run.

Two sessions are wired back to back through a byte pipe that delivers in arbitrary chunks; Hypothesis drives any
interleaving of opens, writes, half-closes and resets on many streams, and the receiver would raise
`mux.window_exceeded` the moment a sender used credit it did not have.
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given, settings, target
from hypothesis import strategies as st

from cubeaccel.protocol.mux import (
    ERROR_CODES,
    FLAG_ACK,
    HEADER,
    HEADER_SIZE,
    VERSION,
    DataReceived,
    Frame,
    FrameDecoder,
    FrameType,
    MuxConfig,
    MuxError,
    PingAnswered,
    ResetCode,
    Session,
    SessionEnding,
    StreamClosed,
    StreamHalfClosed,
    StreamOpened,
    StreamReset,
    WindowOpened,
    data_frame,
)

SMALL = MuxConfig(max_frame=64, initial_window=256, max_streams=8)


def frames_strategy() -> st.SearchStrategy[Frame]:
    sid = st.integers(1, 2**32 - 1)
    return st.one_of(
        st.builds(lambda s, p: data_frame(s, p), sid, st.binary(max_size=64)),
        st.builds(lambda s: Frame(FrameType.OPEN, s), sid),
        st.builds(lambda s: Frame(FrameType.CLOSE, s), sid),
        st.builds(lambda s, n: Frame(FrameType.WINDOW, s, length=n), sid, st.integers(1, 2**31 - 1)),
        st.builds(lambda s, c: Frame(FrameType.RESET, s, length=c), st.integers(0, 2**32 - 1), st.integers(0, 9)),
        st.builds(
            lambda v, ack: Frame(FrameType.PING, 0, FLAG_ACK if ack else 0, v), st.integers(0, 2**32 - 1), st.booleans()
        ),
    )


def chunked(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(points)]


@given(st.lists(frames_strategy(), max_size=30), st.lists(st.integers(0, 10_000), max_size=20))
def test_any_frames_round_trip_through_any_chunking(frames: list[Frame], cuts: list[int]) -> None:
    wire = b"".join(f.encode() for f in frames)
    decoder = FrameDecoder(max_frame=64)
    out: list[Frame] = []
    for piece in chunked(wire, cuts):
        out += decoder.feed(piece)
        assert decoder.buffered < HEADER_SIZE + 64  # never more than one unfinished frame
    decoder.finish()
    assert out == frames


@given(frames_strategy(), st.data())
def test_a_frame_cut_short_is_truncated_at_eof(frame: Frame, data: st.DataObject) -> None:
    wire = frame.encode()
    cut = data.draw(st.integers(1, len(wire) - 1))
    decoder = FrameDecoder(max_frame=64)
    assert decoder.feed(wire[:cut]) == []
    with pytest.raises(MuxError) as err:
        decoder.finish()
    assert err.value.code == "mux.truncated"
    assert err.value.layer == "workload"


@given(st.integers(65, 2**32 - 1))
def test_oversize_data_is_refused_from_the_header_alone(length: int) -> None:
    decoder = FrameDecoder(max_frame=64)
    with pytest.raises(MuxError) as err:
        decoder.feed(HEADER.pack(VERSION, FrameType.DATA, 0, 1, length))  # no payload sent: nothing buffered
    assert err.value.code == "mux.oversize"
    with pytest.raises(MuxError):  # the decoder stays dead: the channel cannot be resynchronised
        decoder.feed(data_frame(1, b"x").encode())


@pytest.mark.parametrize(
    ("header", "code"),
    [
        ((2, FrameType.DATA, 0, 1, 0), "mux.bad_version"),
        ((VERSION, 9, 0, 1, 0), "mux.unknown_type"),
        ((VERSION, FrameType.DATA, FLAG_ACK, 1, 0), "mux.bad_flags"),
        ((VERSION, FrameType.OPEN, 0, 1, 5), "mux.protocol"),
        ((VERSION, FrameType.WINDOW, 0, 1, 0), "mux.protocol"),
        ((VERSION, FrameType.DATA, 0, 0, 1), "mux.protocol"),
        ((VERSION, FrameType.PING, 0, 3, 1), "mux.protocol"),
    ],
)
def test_bad_headers_have_stable_codes(header: tuple[int, int, int, int, int], code: str) -> None:
    with pytest.raises(MuxError) as err:
        FrameDecoder(max_frame=64).feed(HEADER.pack(*header))
    assert err.value.code == code


@given(st.binary(max_size=400), st.lists(st.integers(0, 400), max_size=8))
def test_garbage_gives_frames_or_a_coded_error_never_a_crash(garbage: bytes, cuts: list[int]) -> None:
    session = Session(client=True, config=SMALL)
    try:
        for piece in chunked(garbage, cuts):
            session.receive(piece)
            session.data_to_send()
        session.receive_eof()
    except MuxError as err:
        assert err.code in ERROR_CODES
        with pytest.raises(MuxError):
            session.receive(b"")  # a failed session refuses further input


# ---- two sessions back to back ------------------------------------------------------------------------------


@dataclass
class End:
    """One side plus what its application has seen, per stream."""

    session: Session
    received: dict[int, bytearray] = field(default_factory=dict)
    eof: set[int] = field(default_factory=set)
    opened: list[int] = field(default_factory=list)
    resets: set[int] = field(default_factory=set)
    pending: dict[int, bytearray] = field(default_factory=dict)  # what the app still wants to send
    unconsumed: dict[int, int] = field(default_factory=dict)

    def handle(self, events: Sequence[object]) -> None:
        for ev in events:
            if isinstance(ev, StreamOpened):
                self.opened.append(ev.stream_id)
            elif isinstance(ev, DataReceived):
                self.received.setdefault(ev.stream_id, bytearray()).extend(ev.data)
                self.unconsumed[ev.stream_id] = self.unconsumed.get(ev.stream_id, 0) + len(ev.data)
                assert self.unconsumed[ev.stream_id] <= self.session.config.initial_window  # bounded buffer
            elif isinstance(ev, StreamHalfClosed):
                self.eof.add(ev.stream_id)
            elif isinstance(ev, StreamReset):
                self.resets.add(ev.stream_id)

    def read(self, sid: int) -> None:
        n = self.unconsumed.pop(sid, 0)
        self.session.consume(sid, n)

    def flush(self, sid: int) -> None:
        buf = self.pending.get(sid)
        if buf and sid in self.session.streams and self.session.streams[sid].local_open:
            taken = self.session.send(sid, bytes(buf))
            del buf[:taken]


def pump(a: End, b: End, cuts: list[int]) -> None:
    """Move bytes both ways until quiet, in arbitrary chunks; the apps read and keep writing as credit returns."""
    for _ in range(10_000):
        moved = False
        for src, dst in ((a, b), (b, a)):
            wire = src.session.data_to_send()
            if wire:
                moved = True
                for piece in chunked(wire, cuts):
                    dst.handle(dst.session.receive(piece))
        for end in (a, b):
            for sid in list(end.unconsumed):
                end.read(sid)
            for sid in list(end.pending):
                end.flush(sid)
        if not moved:
            return
    raise AssertionError("pipe never went quiet")


write = st.tuples(st.just("write"), st.integers(0, 7), st.binary(min_size=1, max_size=700), st.booleans())
op = st.one_of(
    write,
    write,
    write,
    st.tuples(st.just("open"), st.booleans()),
    st.tuples(st.just("close"), st.integers(0, 7), st.booleans()),
    st.tuples(st.just("pump"), st.lists(st.integers(0, 2000), max_size=5)),
)


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 6), st.lists(op, min_size=5, max_size=60), st.lists(st.integers(0, 2000), max_size=5))
def test_any_interleaving_of_streams_round_trips_within_the_windows(
    first: int, ops: list[tuple[Any, ...]], cuts: list[int]
) -> None:
    host, guest = End(Session(client=True, config=SMALL)), End(Session(client=False, config=SMALL))
    sent: dict[int, bytearray] = {}  # (stream id) -> everything the *host* app wrote on it
    sent_back: dict[int, bytearray] = {}
    streams = [host.session.open_stream() for _ in range(first)]
    total = 0
    closed: set[tuple[bool, int]] = set()
    for o in ops:
        if o[0] == "open":
            if len(host.session.streams) < SMALL.max_streams:
                streams.append(host.session.open_stream())
        elif o[0] == "write" and streams:
            sid = streams[o[1] % len(streams)]
            from_host = o[3]
            end, log = (host, sent) if from_host else (guest, sent_back)
            if (from_host, sid) in closed or sid not in end.session.streams:
                continue
            end.pending.setdefault(sid, bytearray()).extend(o[2])
            log.setdefault(sid, bytearray()).extend(o[2])
            total += len(o[2])
            end.flush(sid)
        elif o[0] == "close" and streams:
            sid = streams[o[1] % len(streams)]
            end = host if o[2] else guest
            if sid in end.session.streams and not end.pending.get(sid):
                end.session.close(sid)
                closed.add((o[2], sid))
        elif o[0] == "pump":
            pump(host, guest, o[1])
    pump(host, guest, cuts)
    assert guest.opened == [s for s in streams if s in guest.opened] and set(guest.opened) <= set(streams)
    for sid, data in sent.items():
        assert guest.received.get(sid, b"") == data, f"stream {sid} host→guest"
    for sid, data in sent_back.items():
        assert host.received.get(sid, b"") == data, f"stream {sid} guest→host"
    for from_host, sid in closed:
        assert sid in (guest.eof if from_host else host.eof)
    assert all(s % 2 == 1 for s in streams)
    target(float(total))  # steer towards streams that carry many windows of data


def test_half_close_both_ways_retires_the_stream() -> None:
    host, guest = End(Session(client=True, config=SMALL)), End(Session(client=False, config=SMALL))
    sid = host.session.open_stream()
    host.session.send(sid, b"request")
    host.session.close(sid)
    pump(host, guest, [])
    assert guest.received[sid] == b"request" and sid in guest.eof
    guest.session.send(sid, b"reply")  # the guest's half is still open after the host's half-close
    events = guest.session.data_to_send()
    guest.session.close(sid)
    assert sid not in guest.session.streams  # both halves closed on the guest side
    host.handle(host.session.receive(events + guest.session.data_to_send()))
    assert host.received[sid] == b"reply" and sid in host.eof
    assert sid not in host.session.streams
    with pytest.raises(MuxError) as err:
        host.session.send(sid, b"late")
    assert err.value.code == "mux.stream_closed"


def test_sender_stops_at_the_window_and_resumes_when_credit_returns() -> None:
    host, guest = Session(client=True, config=SMALL), Session(client=False, config=SMALL)
    sid = host.open_stream()
    assert host.send(sid, b"x" * 1000) == SMALL.initial_window
    assert host.send(sid, b"more") == 0
    events = guest.receive(host.data_to_send())
    assert sum(len(e.data) for e in events if isinstance(e, DataReceived)) == SMALL.initial_window
    guest.consume(sid, SMALL.initial_window // 2 - 1)
    assert guest.data_to_send() == b""  # credit is returned in batches of at least half a window
    guest.consume(sid, 1)
    opened = host.receive(guest.data_to_send())
    assert opened == [WindowOpened(sid, SMALL.initial_window // 2)]


def test_a_peer_that_ignores_the_window_is_cut_off() -> None:
    guest = Session(client=False, config=SMALL)
    guest.receive(Frame(FrameType.OPEN, 1).encode())
    wire = b"".join(data_frame(1, b"y" * 64).encode() for _ in range(SMALL.initial_window // 64 + 1))
    with pytest.raises(MuxError) as err:
        guest.receive(wire)
    assert err.value.code == "mux.window_exceeded"


def test_stream_rules() -> None:
    guest = Session(client=False, config=SMALL)
    with pytest.raises(MuxError) as err:
        guest.receive(Frame(FrameType.OPEN, 2).encode())  # the client opens odd ids only
    assert err.value.code == "mux.protocol"
    guest = Session(client=False, config=SMALL)
    with pytest.raises(MuxError) as err:
        guest.receive(data_frame(7, b"x").encode())  # DATA on a stream nobody opened
    assert err.value.code == "mux.protocol"
    guest = Session(client=False, config=SMALL)
    guest.receive(Frame(FrameType.OPEN, 1).encode() + Frame(FrameType.CLOSE, 1).encode())
    with pytest.raises(MuxError) as err:
        guest.receive(data_frame(1, b"x").encode())  # DATA after the peer's own half-close
    assert err.value.code == "mux.protocol"


def test_frames_that_cross_a_reset_are_dropped_not_fatal() -> None:
    guest = Session(client=False, config=SMALL)
    guest.receive(Frame(FrameType.OPEN, 1).encode())
    guest.reset(1)
    assert guest.data_to_send() == Frame(FrameType.RESET, 1, length=ResetCode.CANCEL).encode()
    assert guest.receive(data_frame(1, b"in flight").encode() + Frame(FrameType.WINDOW, 1, length=5).encode()) == []


def test_too_many_streams_are_refused_per_stream() -> None:
    guest = Session(client=False, config=SMALL)
    wire = b"".join(Frame(FrameType.OPEN, 2 * i + 1).encode() for i in range(SMALL.max_streams + 1))
    events = guest.receive(wire)
    assert len([e for e in events if isinstance(e, StreamOpened)]) == SMALL.max_streams
    refused = 2 * SMALL.max_streams + 1
    assert guest.data_to_send() == Frame(FrameType.RESET, refused, length=ResetCode.REFUSED).encode()


def test_ping_is_answered_and_a_ping_flood_is_cut_off() -> None:
    host, guest = Session(client=True, config=SMALL), Session(client=False, config=SMALL)
    value = host.ping()
    guest.receive(host.data_to_send())
    events = host.receive(guest.data_to_send())
    assert events == [PingAnswered(value)]
    flood = Frame(FrameType.PING, 0, 0, 1).encode() * (SMALL.max_control_backlog // HEADER_SIZE + 1)
    with pytest.raises(MuxError) as err:
        guest.receive(flood)  # never drained: the answers would pile up without bound
    assert err.value.code == "mux.flood"


def test_reset_and_go_away() -> None:
    host, guest = Session(client=True, config=SMALL), Session(client=False, config=SMALL)
    a, b = host.open_stream(), host.open_stream()
    guest.receive(host.data_to_send())
    guest.reset(a, ResetCode.CANCEL)
    assert host.receive(guest.data_to_send()) == [StreamReset(a, ResetCode.CANCEL), StreamClosed(a)]
    guest.go_away()
    assert host.receive(guest.data_to_send()) == [SessionEnding(ResetCode.GOING_AWAY), StreamClosed(b)]
    with pytest.raises(MuxError) as err:
        host.open_stream()
    assert err.value.code == "mux.session_closed"


def test_eof_mid_frame_fails_the_session() -> None:
    guest = Session(client=False, config=SMALL)
    guest.receive(Frame(FrameType.OPEN, 1).encode() + data_frame(1, b"abcdef").encode()[:-2])
    with pytest.raises(MuxError) as err:
        guest.receive_eof()
    assert err.value.code == "mux.truncated"


def test_header_layout_is_twelve_big_endian_bytes() -> None:
    assert HEADER_SIZE == 12
    assert data_frame(0x01020304, b"hi").encode() == struct.pack(">BBHII", 1, 1, 0, 0x01020304, 2) + b"hi"
