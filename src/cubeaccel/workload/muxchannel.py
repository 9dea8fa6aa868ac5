"""The mux session (protocol/mux.py) driven over a real byte channel; its streams are `Connection`s.

Guest side: `MuxChannel(fd, fd, client=False)` is a `Listener` (`accept()` returns each stream the host opens),
so the HTTP server runs over a virtio-serial port unchanged. Host side (and tests): `client=True`, `open()`.

Two threads per channel: a reader feeds the session and never writes; a writer drains the session's output
in order and is the only thread that writes, so a peer that stops reading blocks our writer, never our reader
(both ends blocked in write(2) is the deadlock this layout avoids). Per stream, what a reader has not consumed is
bounded by the window; a writer waits for credit.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import select
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing_extensions import Buffer

from cubeaccel.protocol.mux import (
    DataReceived,
    MuxConfig,
    MuxError,
    ResetCode,
    Session,
    SessionEnding,
    StreamClosed,
    StreamHalfClosed,
    StreamOpened,
    StreamReset,
    WindowOpened,
)
from cubeaccel.workload.http1 import Connection, ListenerClosed

READ_SIZE = 64 * 1024


@dataclass
class _Stream:
    sid: int
    data: deque[bytes] = field(default_factory=deque)
    eof: bool = False  # the peer half-closed
    reset: bool = False
    abandoned: bool = False  # our reader is gone: what still arrives is credited back and dropped
    write_closed: bool = False


class MuxChannel:
    def __init__(self, rfd: int, wfd: int, client: bool, config: MuxConfig | None = None) -> None:
        self.rfd, self.wfd = rfd, wfd
        self.session = Session(client=client, config=config or MuxConfig())
        self._cv = threading.Condition()
        self._streams: dict[int, _Stream] = {}
        self._incoming: deque[int] = deque()
        self.error: MuxError | OSError | None = None
        self.ended = False
        self._closing = False  # close() asked: the writer flushes what is queued (the GOAWAY) and stops
        self._reader = threading.Thread(target=self._read_loop, daemon=True, name="mux reader")
        self._writer = threading.Thread(target=self._write_loop, daemon=True, name="mux writer")
        self._reader.start()
        self._writer.start()

    # ---- Listener / dialer ---------------------------------------------------------------------------------
    def accept(self) -> Connection:
        with self._cv:
            while not self._incoming and not self.ended:
                self._cv.wait()
            if not self._incoming:
                raise ListenerClosed(str(self.error or "channel ended"))
            return self._connection(self._incoming.popleft())

    def open(self) -> Connection:
        with self._cv:
            if self.ended:
                raise ListenerClosed(str(self.error or "channel ended"))
            sid = self.session.open_stream()
            self._streams[sid] = _Stream(sid)
            self._cv.notify_all()
            return self._connection(sid)

    def close(self) -> None:
        with self._cv:
            if not self.ended:
                with contextlib.suppress(MuxError):
                    self.session.go_away()
            self._closing = True
            self._cv.notify_all()
        self._writer.join(5)  # bounded: a peer that stopped reading cannot hold us
        self._end(None)

    def _connection(self, sid: int) -> Connection:
        raw = _StreamIO(self, sid)
        reader = io.BufferedReader(raw, READ_SIZE)
        writer = io.BufferedWriter(raw, READ_SIZE)

        def close() -> None:
            with contextlib.suppress(OSError, ValueError):
                writer.flush()
            self._close_stream(sid)

        return Connection(reader, writer, close, peer=f"mux:{sid}")

    # ---- stream operations (called by _StreamIO) -----------------------------------------------------------
    def _readinto(self, sid: int, buf: memoryview) -> int:
        with self._cv:
            stream = self._streams.get(sid)
            while stream is not None and not stream.data and not stream.eof and not stream.reset and not self.ended:
                self._cv.wait()
            if stream is None or (not stream.data and (stream.reset or (self.ended and not stream.eof))):
                raise ConnectionResetError(errno.ECONNRESET, "mux stream reset")
            if not stream.data:
                return 0
            n = 0
            while stream.data and n < len(buf):
                head = stream.data[0]
                take = min(len(head), len(buf) - n)
                buf[n : n + take] = head[:take]
                n += take
                if take == len(head):
                    stream.data.popleft()
                else:
                    stream.data[0] = head[take:]
            self._credit(sid, n)
            return n

    def _write(self, sid: int, data: memoryview) -> int:
        with self._cv:
            while True:
                stream = self._streams.get(sid)
                if stream is None or stream.reset or self.ended or stream.write_closed:
                    raise BrokenPipeError(errno.EPIPE, "mux stream closed")
                window = self.session.send_window(sid)
                if window > 0:
                    n = self.session.send(sid, bytes(data[:window]))  # copy only what the credit allows
                    self._cv.notify_all()
                    return n
                self._cv.wait()

    def _close_stream(self, sid: int) -> None:
        with self._cv:
            stream = self._streams.get(sid)
            if stream is None or self.ended:
                self._streams.pop(sid, None)
                return
            stream.abandoned = True
            dropped = sum(len(d) for d in stream.data)
            stream.data.clear()
            self._credit(sid, dropped)
            if not stream.write_closed:
                stream.write_closed = True
                with contextlib.suppress(MuxError):
                    self.session.close(sid)
            if sid not in self.session.streams:
                self._streams.pop(sid, None)
            self._cv.notify_all()

    def _credit(self, sid: int, n: int) -> None:
        if n:
            with contextlib.suppress(MuxError):
                self.session.consume(sid, n)
            self._cv.notify_all()

    # ---- the two threads -----------------------------------------------------------------------------------
    def _read_loop(self) -> None:
        while True:
            try:
                data = os.read(self.rfd, READ_SIZE)
            except BlockingIOError:
                select.select([self.rfd], [], [])
                continue
            except OSError as exc:
                self._end(exc)
                return
            with self._cv:
                try:
                    events = self.session.receive(data) if data else self.session.receive_eof()
                except MuxError as err:
                    with contextlib.suppress(MuxError):
                        self.session.go_away(ResetCode.PROTOCOL)  # best effort: tell the peer why, then stop
                    self.error = err
                    events = []
                for ev in events:
                    self._apply(ev)
                self._cv.notify_all()
                if not data or self.error is not None or self.session.closed:
                    break
        self._end(self.error)

    def _apply(self, ev: object) -> None:
        if isinstance(ev, StreamOpened):
            self._streams[ev.stream_id] = _Stream(ev.stream_id)
            self._incoming.append(ev.stream_id)
        elif isinstance(ev, DataReceived):
            stream = self._streams.get(ev.stream_id)
            if stream is None or stream.abandoned:
                self._credit(ev.stream_id, len(ev.data))
            else:
                stream.data.append(ev.data)
        elif isinstance(ev, StreamHalfClosed):
            if (stream := self._streams.get(ev.stream_id)) is not None:
                stream.eof = True
                if stream.abandoned and ev.stream_id not in self.session.streams:
                    self._streams.pop(ev.stream_id, None)
        elif isinstance(ev, StreamReset):
            if (stream := self._streams.get(ev.stream_id)) is not None:
                stream.reset = True
        elif isinstance(ev, StreamClosed):
            stream = self._streams.get(ev.stream_id)
            if stream is not None and (stream.abandoned or stream.reset):
                self._streams.pop(ev.stream_id, None)
        elif isinstance(ev, SessionEnding):
            self.ended = True
        elif isinstance(ev, WindowOpened):
            pass  # writers wake on notify_all

    def _write_loop(self) -> None:
        while True:
            with self._cv:
                while not self.session.pending_output and not self.ended and not self._closing:
                    self._cv.wait()
                out = self.session.data_to_send()
                finished = self.ended or self._closing
            if out:
                try:
                    _write_all(self.wfd, out)
                except OSError as exc:
                    self._end(exc)
                    return
            if finished and not out:
                return

    def _end(self, error: MuxError | OSError | None) -> None:
        with self._cv:
            if self.error is None:
                self.error = error
            self.ended = True
            self._cv.notify_all()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view) :]
        except BlockingIOError:
            select.select([], [fd], [])


class _StreamIO(io.RawIOBase):
    def __init__(self, channel: MuxChannel, sid: int) -> None:
        self._ch, self._sid = channel, sid

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def readinto(self, buf: Buffer, /) -> int:
        return self._ch._readinto(self._sid, memoryview(buf).cast("B"))

    def write(self, data: Buffer, /) -> int:
        return self._ch._write(self._sid, memoryview(data).cast("B"))
