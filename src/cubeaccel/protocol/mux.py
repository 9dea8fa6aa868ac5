"""Many byte streams over one ordered byte channel (a virtio-serial port): framing and a sans-I/O session.

Both ends run the same `Session`; it never touches a file descriptor. The caller feeds it what the channel
delivered (`receive`) and writes what it produced (`data_to_send`). Layout and rules are yamux's, smaller:

    header (12 bytes, big-endian): version u8 | type u8 | flags u16 | stream_id u32 | length u32
    OPEN    length 0            the sender opens `stream_id` (client ids odd, server ids even)
    DATA    length = payload    1..max_frame bytes follow; never more than the receiver's remaining credit
    WINDOW  length = increment  the receiver grants more credit (no payload)
    CLOSE   length 0            half-close: the sender will send no more DATA on this stream
    RESET   length = code       abort the stream both ways (stream 0: the whole session is ending)
    PING    length = opaque     flags ACK=1 marks the answer; stream 0

A stream is closed when both halves are closed, or at once on RESET. Every stream starts with
`initial_window` bytes of credit in each direction, so what a receiver buffers per stream is bounded by it; the
receiver returns credit as its reader consumes (`consume`), in batches of at least half a window. A violation
is fatal to the session (`MuxError`, stable code): the channel is then unusable and the caller tears it down.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from enum import IntEnum

from cubeaccel.protocol.errors import CubeError

VERSION = 1
HEADER = struct.Struct(">BBHII")
HEADER_SIZE = HEADER.size  # 12
FLAG_ACK = 0x1
MAX_WINDOW = 2**31 - 1

DEFAULT_MAX_FRAME = 64 * 1024
DEFAULT_INITIAL_WINDOW = 256 * 1024
DEFAULT_MAX_STREAMS = 256
DEFAULT_MAX_CONTROL_BACKLOG = 64 * 1024  # unsent control bytes (ping answers, resets) before the peer is a flooder

# The workload channel: its virtserialport name, and the line the host writes before each session's first frame.
# The access token travels on the channel itself, so a guest restored from a template snapshot (booted before its
# sandbox had a token) learns it from the shim that restored it; only the host end can write to the port.
WORKLOAD_PORT_NAME = "org.cubeaccel.workload.0"
TOKEN_PREAMBLE = b"CUBE-WORKLOAD-TOKEN "
MAX_PREAMBLE = 256


def token_preamble(token: str) -> bytes:
    """`CUBE-WORKLOAD-TOKEN <token>\\n`: a token is URL-safe text, never a newline or a space."""
    raw = token.encode()
    if not raw or len(TOKEN_PREAMBLE) + len(raw) + 1 > MAX_PREAMBLE or any(c <= 0x20 or c > 0x7E for c in raw):
        raise ValueError("a workload token is 1..200 printable ASCII characters without spaces")
    return TOKEN_PREAMBLE + raw + b"\n"


def parse_preamble(line: bytes) -> bytes | None:
    """The token of a preamble line (without its newline), or None when the line is not one."""
    if not line.startswith(TOKEN_PREAMBLE):
        return None
    token = line[len(TOKEN_PREAMBLE) :]
    if not token or any(c <= 0x20 or c > 0x7E for c in token):
        return None
    return token


class FrameType(IntEnum):
    OPEN = 0
    DATA = 1
    WINDOW = 2
    CLOSE = 3
    RESET = 4
    PING = 5


class ResetCode(IntEnum):
    """Why a stream (or, on stream 0, the session) was reset; travels in RESET's length field."""

    CANCEL = 0  # the application gave up on the stream
    REFUSED = 1  # too many streams open; the opener may retry later
    PROTOCOL = 2  # the peer broke a rule (sent by the side that saw it, before it drops the channel)
    GOING_AWAY = 3  # session shutdown


ERROR_CODES = (
    "mux.bad_version",
    "mux.unknown_type",
    "mux.bad_flags",
    "mux.oversize",
    "mux.truncated",
    "mux.window_exceeded",
    "mux.window_overflow",
    "mux.protocol",
    "mux.flood",
    "mux.session_closed",
    "mux.stream_closed",
)


class MuxError(CubeError):
    """A channel-level failure. `layer` is `channel`: neither host nor workload code is at fault by name."""


def mux_error(code: str, message: str, **details: object) -> MuxError:
    return MuxError(code=code, message=message, layer="workload", details=dict(details), status=502)


@dataclass(frozen=True)
class Frame:
    type: FrameType
    stream_id: int
    flags: int = 0
    length: int = 0  # WINDOW increment, RESET code, PING opaque value; DATA: len(payload)
    payload: bytes = b""

    def encode(self) -> bytes:
        length = len(self.payload) if self.type is FrameType.DATA else self.length
        return HEADER.pack(VERSION, self.type, self.flags, self.stream_id, length) + self.payload


def data_frame(stream_id: int, payload: bytes) -> Frame:
    return Frame(FrameType.DATA, stream_id, length=len(payload), payload=payload)


@dataclass
class FrameDecoder:
    """Bytes in, frames out. Holds at most one header plus one payload (≤ `max_frame`) of unfinished frame."""

    max_frame: int = DEFAULT_MAX_FRAME
    _buf: bytearray = field(default_factory=bytearray)
    _header: tuple[int, int, int, int, int] | None = None
    _dead: MuxError | None = None

    @property
    def buffered(self) -> int:
        return len(self._buf)

    def feed(self, data: bytes) -> list[Frame]:
        if self._dead is not None:
            raise self._dead
        self._buf += data
        frames: list[Frame] = []
        try:
            while True:
                frame = self._next()
                if frame is None:
                    return frames
                frames.append(frame)
        except MuxError as err:
            self._dead = err
            self._buf = bytearray()
            raise

    def finish(self) -> None:
        """The channel ended: an unfinished frame is an error, not silence."""
        if self._dead is not None:
            raise self._dead
        if self._buf or self._header is not None:
            raise mux_error("mux.truncated", "channel ended inside a frame", buffered=len(self._buf))

    def _next(self) -> Frame | None:
        if self._header is None:
            if len(self._buf) < HEADER_SIZE:
                return None
            self._header = self._check(HEADER.unpack_from(self._buf))
            del self._buf[:HEADER_SIZE]
        _, ftype, flags, stream_id, length = self._header
        payload = b""
        if ftype == FrameType.DATA:
            if len(self._buf) < length:
                return None
            payload = bytes(self._buf[:length])
            del self._buf[:length]
        self._header = None
        return Frame(FrameType(ftype), stream_id, flags, length, payload)

    def _check(self, header: tuple[int, int, int, int, int]) -> tuple[int, int, int, int, int]:
        """Reject a bad header before waiting for its payload, so a lying length never makes us buffer."""
        version, ftype, flags, stream_id, length = header
        if version != VERSION:
            raise mux_error("mux.bad_version", f"frame version {version}, expected {VERSION}", version=version)
        if ftype not in FrameType._value2member_map_:
            raise mux_error("mux.unknown_type", f"unknown frame type {ftype}", type=ftype)
        if flags & ~(FLAG_ACK if ftype == FrameType.PING else 0):
            raise mux_error("mux.bad_flags", f"flags {flags:#x} not allowed on {FrameType(ftype).name}", flags=flags)
        if ftype == FrameType.DATA and length > self.max_frame:
            raise mux_error("mux.oversize", f"DATA frame of {length} bytes exceeds {self.max_frame}", length=length)
        if ftype in (FrameType.OPEN, FrameType.CLOSE) and length != 0:
            raise mux_error("mux.protocol", f"{FrameType(ftype).name} carries length {length}", length=length)
        if ftype == FrameType.WINDOW and not 0 < length <= MAX_WINDOW:
            raise mux_error("mux.protocol", f"window increment {length} out of range", length=length)
        if (stream_id == 0) != (ftype == FrameType.PING or (ftype == FrameType.RESET and stream_id == 0)):
            raise mux_error(
                "mux.protocol", f"{FrameType(ftype).name} on stream {stream_id}", type=ftype, stream_id=stream_id
            )
        return header


@dataclass(frozen=True)
class MuxConfig:
    max_frame: int = DEFAULT_MAX_FRAME
    initial_window: int = DEFAULT_INITIAL_WINDOW
    max_streams: int = DEFAULT_MAX_STREAMS
    max_control_backlog: int = DEFAULT_MAX_CONTROL_BACKLOG


# Events the session reports to its caller (what arrived, in order).
@dataclass(frozen=True)
class StreamOpened:
    stream_id: int


@dataclass(frozen=True)
class DataReceived:
    stream_id: int
    data: bytes


@dataclass(frozen=True)
class StreamHalfClosed:
    """The peer will send no more on this stream (EOF for the reader)."""

    stream_id: int


@dataclass(frozen=True)
class StreamReset:
    stream_id: int
    code: int


@dataclass(frozen=True)
class StreamClosed:
    """Both halves closed (or reset): the id is retired."""

    stream_id: int


@dataclass(frozen=True)
class WindowOpened:
    """More send credit on this stream: a writer blocked on it may continue."""

    stream_id: int
    send_window: int


@dataclass(frozen=True)
class PingAnswered:
    value: int


@dataclass(frozen=True)
class SessionEnding:
    """The peer reset stream 0: it is shutting the session down."""

    code: int


Event = (
    StreamOpened
    | DataReceived
    | StreamHalfClosed
    | StreamReset
    | StreamClosed
    | WindowOpened
    | PingAnswered
    | SessionEnding
)


@dataclass
class StreamState:
    stream_id: int
    send_window: int  # bytes we may still send
    recv_window: int  # bytes the peer may still send us
    unacked: int = 0  # bytes consumed by our reader but not yet returned as credit
    local_open: bool = True  # we may send
    remote_open: bool = True  # the peer may send


@dataclass
class Session:
    """One end of a multiplexed channel. `client=True` opens odd stream ids, the other end even ones."""

    client: bool
    config: MuxConfig = field(default_factory=MuxConfig)
    streams: dict[int, StreamState] = field(default_factory=dict)
    _decoder: FrameDecoder = field(init=False)
    _out: bytearray = field(default_factory=bytearray)
    _control: int = 0  # control bytes in _out (data bytes are bounded by windows, control bytes by this)
    _next_local: int = field(init=False)
    _highest_remote: int = 0
    _next_ping: int = 1
    _dead: MuxError | None = None
    closed: bool = False

    def __post_init__(self) -> None:
        self._decoder = FrameDecoder(self.config.max_frame)
        self._next_local = 1 if self.client else 2

    # ---- what the application does -------------------------------------------------------------------------
    def open_stream(self) -> int:
        self._alive()
        if len(self.streams) >= self.config.max_streams:
            raise mux_error("mux.protocol", f"already {len(self.streams)} streams open", limit=self.config.max_streams)
        stream_id = self._next_local
        if stream_id > 0xFFFFFFFF:
            raise mux_error("mux.protocol", "stream ids exhausted")
        self._next_local += 2
        self.streams[stream_id] = self._new_stream(stream_id)
        self._emit(Frame(FrameType.OPEN, stream_id))
        return stream_id

    def send(self, stream_id: int, data: bytes) -> int:
        """Queue as much of `data` as the peer's credit allows; returns how many bytes were taken."""
        self._alive()
        stream = self._local_stream(stream_id)
        if not stream.local_open:
            raise mux_error("mux.stream_closed", f"stream {stream_id} is closed for sending", stream_id=stream_id)
        taken = 0
        view = memoryview(data)
        while taken < len(data) and stream.send_window > 0:
            n = min(len(data) - taken, stream.send_window, self.config.max_frame)
            self._emit(data_frame(stream_id, bytes(view[taken : taken + n])), control=False)
            stream.send_window -= n
            taken += n
        return taken

    def send_window(self, stream_id: int) -> int:
        stream = self.streams.get(stream_id)
        return stream.send_window if stream is not None and stream.local_open else 0

    def consume(self, stream_id: int, n: int) -> None:
        """The reader took `n` received bytes off this stream: give the peer that much credit back (batched)."""
        stream = self.streams.get(stream_id)
        if stream is None or not stream.remote_open or n <= 0:
            return
        stream.unacked += n
        if stream.unacked >= self.config.initial_window // 2:
            stream.recv_window += stream.unacked
            self._emit(Frame(FrameType.WINDOW, stream_id, length=stream.unacked))
            stream.unacked = 0

    def close(self, stream_id: int) -> None:
        """Half-close our side; idempotent."""
        self._alive()
        stream = self.streams.get(stream_id)
        if stream is None or not stream.local_open:
            return
        stream.local_open = False
        self._emit(Frame(FrameType.CLOSE, stream_id))
        self._maybe_retire(stream)

    def reset(self, stream_id: int, code: int = ResetCode.CANCEL) -> None:
        self._alive()
        if self.streams.pop(stream_id, None) is not None:
            self._emit(Frame(FrameType.RESET, stream_id, length=code))

    def ping(self) -> int:
        self._alive()
        value, self._next_ping = self._next_ping, (self._next_ping + 1) & 0xFFFFFFFF
        self._emit(Frame(FrameType.PING, 0, length=value))
        return value

    def go_away(self, code: int = ResetCode.GOING_AWAY) -> None:
        """Tell the peer the session ends; every stream is gone."""
        if not self.closed:
            self._emit(Frame(FrameType.RESET, 0, length=code))
            self.streams.clear()
            self.closed = True

    @property
    def pending_output(self) -> int:
        return len(self._out)

    def data_to_send(self) -> bytes:
        out, self._out, self._control = bytes(self._out), bytearray(), 0
        return out

    # ---- what arrived ---------------------------------------------------------------------------------------
    def receive(self, data: bytes) -> list[Event]:
        self._alive()
        try:
            events: list[Event] = []
            for frame in self._decoder.feed(data):
                self._apply(frame, events)
            return events
        except MuxError as err:
            self._dead = err
            raise

    def receive_eof(self) -> list[Event]:
        """The channel ended: a frame cut short is an error; every stream is closed."""
        self._alive()
        try:
            self._decoder.finish()
        except MuxError as err:
            self._dead = err
            raise
        events: list[Event] = [StreamClosed(sid) for sid in self.streams]
        self.streams.clear()
        self.closed = True
        return events

    def _apply(self, frame: Frame, events: list[Event]) -> None:
        sid = frame.stream_id
        if frame.type is FrameType.PING:
            if frame.flags & FLAG_ACK:
                events.append(PingAnswered(frame.length))
            else:
                self._emit(Frame(FrameType.PING, 0, FLAG_ACK, frame.length))
            return
        if frame.type is FrameType.RESET and sid == 0:
            events.append(SessionEnding(frame.length))
            events.extend(StreamClosed(s) for s in self.streams)
            self.streams.clear()
            self.closed = True
            return
        if frame.type is FrameType.OPEN:
            self._open_remote(sid, events)
            return
        stream = self.streams.get(sid)
        if stream is None:
            if self._used(sid):
                return  # a frame that crossed our RESET or CLOSE on the wire: harmless, dropped
            raise mux_error("mux.protocol", f"{frame.type.name} on stream {sid} that was never opened", stream_id=sid)
        if frame.type is FrameType.DATA:
            if not stream.remote_open:
                raise mux_error("mux.protocol", f"DATA on stream {sid} after the peer closed it", stream_id=sid)
            if len(frame.payload) > stream.recv_window:
                raise mux_error(
                    "mux.window_exceeded",
                    f"{len(frame.payload)} bytes on stream {sid} with {stream.recv_window} of credit",
                    stream_id=sid,
                    credit=stream.recv_window,
                )
            stream.recv_window -= len(frame.payload)
            if frame.payload:
                events.append(DataReceived(sid, frame.payload))
        elif frame.type is FrameType.WINDOW:
            if stream.send_window + frame.length > MAX_WINDOW:
                raise mux_error("mux.window_overflow", f"credit on stream {sid} would exceed 2^31-1", stream_id=sid)
            stream.send_window += frame.length
            if stream.local_open:
                events.append(WindowOpened(sid, stream.send_window))
        elif frame.type is FrameType.CLOSE:
            if stream.remote_open:
                stream.remote_open = False
                events.append(StreamHalfClosed(sid))
                self._maybe_retire(stream, events)
        elif frame.type is FrameType.RESET:
            del self.streams[sid]
            events.append(StreamReset(sid, frame.length))
            events.append(StreamClosed(sid))

    def _open_remote(self, sid: int, events: list[Event]) -> None:
        if sid % 2 == (1 if self.client else 0) or sid <= self._highest_remote:
            raise mux_error("mux.protocol", f"peer may not open stream {sid}", stream_id=sid)
        self._highest_remote = sid
        if len(self.streams) >= self.config.max_streams:
            self._emit(Frame(FrameType.RESET, sid, length=ResetCode.REFUSED))
            return
        self.streams[sid] = self._new_stream(sid)
        events.append(StreamOpened(sid))

    def _used(self, sid: int) -> bool:
        ours = sid % 2 == (1 if self.client else 0)
        return sid < self._next_local if ours else sid <= self._highest_remote

    def _new_stream(self, sid: int) -> StreamState:
        window = self.config.initial_window
        return StreamState(sid, send_window=window, recv_window=window)

    def _local_stream(self, stream_id: int) -> StreamState:
        stream = self.streams.get(stream_id)
        if stream is None:
            raise mux_error("mux.stream_closed", f"stream {stream_id} is not open", stream_id=stream_id)
        return stream

    def _maybe_retire(self, stream: StreamState, events: list[Event] | None = None) -> None:
        if not stream.local_open and not stream.remote_open:
            self.streams.pop(stream.stream_id, None)
            if events is not None:
                events.append(StreamClosed(stream.stream_id))

    def _emit(self, frame: Frame, control: bool = True) -> None:
        encoded = frame.encode()
        if control:
            if self._control + len(encoded) > self.config.max_control_backlog:
                err = mux_error("mux.flood", "peer makes us answer faster than the channel drains")
                self._dead = err
                raise err
            self._control += len(encoded)
        self._out += encoded

    def _alive(self) -> None:
        if self._dead is not None:
            raise self._dead
        if self.closed:
            raise mux_error("mux.session_closed", "the session has ended")
