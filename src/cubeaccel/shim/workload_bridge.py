"""The host end of the workload channel: each connection on the sandbox's `workload.sock` becomes one mux stream.

The VMM's workload virtserialport is a unix socket (`workload-vmm.sock`, in the state dir); the shim is its only
client. It writes the token preamble (`model.mux.token_preamble`), then runs the host side of the mux session
(`model.mux.Session`, client: odd stream ids). `workload.sock` (0600, the state dir) is what Cubelet's proxy and
tests connect to; every accepted connection is opened as a stream and pumped both ways.

Bounds: what a slow client has not read is at most one window per stream (the guest waits for credit), and what
a slow guest has not credited stays in the client's socket (we read from a client only when the stream has
credit). One reader thread feeds the session and never writes; one writer thread is the only one to write to the
VMM socket; per stream, one thread each way. Streams are capped at the session's `max_streams`.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from cubeaccel.host.unix_path import connect_path
from cubeaccel.model.errors import CubeError
from cubeaccel.model.mux import (
    DataReceived,
    MuxConfig,
    MuxError,
    ResetCode,
    Session,
    SessionEnding,
    StreamClosed,
    StreamHalfClosed,
    StreamReset,
    token_preamble,
)

CHUNK = 64 * 1024
HEALTH_REQUEST = b"GET /health HTTP/1.1\r\nHost: workload\r\nConnection: close\r\n\r\n"


def workload_error(code: str, message: str, **details: object) -> CubeError:
    return CubeError(code, message, layer="workload", details=dict(details), status=502)


@dataclass
class _Stream:
    sid: int
    data: deque[bytes] = field(default_factory=deque)
    eof: bool = False
    reset: bool = False
    write_closed: bool = False


class WorkloadBridge:
    def __init__(self, vmm_socket: Path, listen: Path, token: str, config: MuxConfig | None = None) -> None:
        self.vmm_socket = vmm_socket
        self.listen_path = listen
        self._preamble = token_preamble(token)
        self.session = Session(client=True, config=config or MuxConfig())
        self._cv = threading.Condition()
        self._streams: dict[int, _Stream] = {}
        self._chan: socket.socket | None = None
        self._listener: socket.socket | None = None
        self.ended = False
        self.error: BaseException | None = None
        self.connections = 0  # accepted so far (tests, reports)

    # ---- lifecycle -----------------------------------------------------------------------------------------
    def start(self, timeout_s: float = 10.0) -> None:
        """Connect to the VMM's port, send the token, start pumping, then listen on `workload.sock`."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                chan = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                chan.connect(connect_path(self.vmm_socket))
                break
            except OSError as e:
                chan.close()
                if time.monotonic() > deadline:
                    raise workload_error("workload.channel_unreachable", f"workload port socket: {e}") from e
                time.sleep(0.02)
        chan.sendall(self._preamble)
        self._chan = chan
        threading.Thread(target=self._read_loop, daemon=True, name="workload mux reader").start()
        threading.Thread(target=self._write_loop, daemon=True, name="workload mux writer").start()
        self.listen_path.unlink(missing_ok=True)
        lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # created 0600: only this sandbox's owner (Cubelet's user) may connect
        try:
            lsock.bind(connect_path(self.listen_path))
        finally:
            os.umask(old)
        os.chmod(self.listen_path, 0o600)
        lsock.listen(64)
        self._listener = lsock
        threading.Thread(target=self._accept_loop, daemon=True, name="workload accept").start()

    def wait_healthy(self, timeout_s: float, cancelled: Callable[[], bool] = lambda: False) -> float:
        """Until the guest service answers `GET /health` over the channel; seconds it took. The service is up
        when it answers, so a start whose service never comes up fails here (`workload.not_up`, layer guest)."""
        t0 = time.monotonic()
        result: list[bytes] = []

        def probe() -> None:
            with contextlib.suppress(OSError, CubeError):
                result.append(self.request(HEALTH_REQUEST))

        thread = threading.Thread(target=probe, daemon=True, name="workload health")
        thread.start()
        while thread.is_alive():
            thread.join(0.1)
            if cancelled():
                raise CubeError("shim.stop_requested", "teardown requested during startup", layer="cubelet")
            if time.monotonic() - t0 > timeout_s:
                raise workload_error(
                    "workload.not_up", f"the guest's workload service did not answer within {timeout_s:.0f} s"
                )
        status = result[0].split(b"\r\n", 1)[0] if result else b""
        if b" 204 " not in status + b" " and not status.endswith(b" 204"):
            detail = str(self.error) if self.error else status.decode(errors="replace")[:100]
            raise workload_error("workload.not_up", f"the guest's workload service is not serving: {detail}")
        return time.monotonic() - t0

    def request(self, raw: bytes, limit: int = 64 * 1024) -> bytes:
        """One request on a fresh stream; the whole reply until the guest closes (at most `limit` bytes)."""
        sid = self._open()
        try:
            self._send_all(sid, raw)
            self._half_close(sid)
            out = bytearray()
            while len(out) < limit and (chunk := self._recv(sid)):
                out += chunk
            return bytes(out)
        finally:
            self._retire(sid)

    def close(self) -> None:
        with self._cv:
            if not self.ended:
                with contextlib.suppress(MuxError):
                    self.session.go_away()
            self._cv.notify_all()
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.close()
            self.listen_path.unlink(missing_ok=True)
        self._end(None, flush_s=2.0)

    # ---- stream operations ---------------------------------------------------------------------------------
    def _open(self) -> int:
        with self._cv:
            if self.ended:
                raise workload_error("workload.channel_closed", f"workload channel ended: {self.error}")
            sid = self.session.open_stream()
            self._streams[sid] = _Stream(sid)
            self._cv.notify_all()
            return sid

    def _send_all(self, sid: int, data: bytes) -> None:
        view = memoryview(data)
        while view:
            with self._cv:
                while True:
                    stream = self._streams.get(sid)
                    if stream is None or stream.reset or self.ended or stream.write_closed:
                        raise BrokenPipeError("workload stream closed")
                    window = self.session.send_window(sid)
                    if window > 0:
                        n = self.session.send(sid, bytes(view[:window]))
                        self._cv.notify_all()
                        break
                    self._cv.wait()
            view = view[n:]

    def _wait_credit(self, sid: int) -> int:
        with self._cv:
            while True:
                stream = self._streams.get(sid)
                if stream is None or stream.reset or self.ended:
                    return 0
                window = self.session.send_window(sid)
                if window > 0:
                    return window
                self._cv.wait()

    def _half_close(self, sid: int) -> None:
        with self._cv:
            stream = self._streams.get(sid)
            if stream is not None and not stream.write_closed and not self.ended:
                stream.write_closed = True
                with contextlib.suppress(MuxError):
                    self.session.close(sid)
                self._cv.notify_all()

    def _recv(self, sid: int) -> bytes:
        """Next data of the stream (credit returned at once: the caller has taken it), b"" at its end."""
        with self._cv:
            while True:
                stream = self._streams.get(sid)
                if stream is None:
                    return b""
                if stream.data:
                    chunk = stream.data.popleft()
                    with contextlib.suppress(MuxError):
                        self.session.consume(sid, len(chunk))
                    self._cv.notify_all()
                    return chunk
                if stream.eof or stream.reset or self.ended:
                    return b""
                self._cv.wait()

    def _retire(self, sid: int) -> None:
        with self._cv:
            stream = self._streams.pop(sid, None)
            if stream is not None and not self.ended:
                with contextlib.suppress(MuxError):
                    if not stream.eof or not stream.write_closed:
                        self.session.reset(sid, ResetCode.CANCEL)  # the client went away before the end
                    if stream.data:
                        self.session.consume(sid, sum(len(d) for d in stream.data))
            self._cv.notify_all()

    # ---- threads -------------------------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        assert self._listener is not None
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                sid = self._open()
            except (CubeError, MuxError):
                client.close()  # channel gone, or too many streams: the caller sees a closed connection
                continue
            self.connections += 1
            threading.Thread(target=self._serve, args=(client, sid), daemon=True, name=f"workload {sid}").start()

    def _serve(self, client: socket.socket, sid: int) -> None:
        up = threading.Thread(target=self._up, args=(client, sid), daemon=True, name=f"workload {sid} up")
        up.start()
        try:
            while chunk := self._recv(sid):
                client.sendall(chunk)
            with contextlib.suppress(OSError):
                client.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        finally:
            up.join(30)
            self._retire(sid)
            client.close()

    def _up(self, client: socket.socket, sid: int) -> None:
        try:
            while (window := self._wait_credit(sid)) > 0:
                data = client.recv(min(CHUNK, window))
                if not data:
                    break
                self._send_all(sid, data)
        except OSError:
            pass
        finally:
            self._half_close(sid)

    def _read_loop(self) -> None:
        assert self._chan is not None
        while True:
            try:
                data = self._chan.recv(CHUNK)
            except OSError as exc:
                self._end(exc)
                return
            with self._cv:
                try:
                    events = self.session.receive(data) if data else self.session.receive_eof()
                except MuxError as err:
                    with contextlib.suppress(MuxError):
                        self.session.go_away(ResetCode.PROTOCOL)
                    self.error = err
                    events = []
                for ev in events:
                    self._apply(ev)
                self._cv.notify_all()
                if not data or self.error is not None or self.session.closed:
                    break
        self._end(self.error or workload_error("workload.channel_closed", "the guest closed the channel"))

    def _apply(self, ev: object) -> None:
        if isinstance(ev, DataReceived):
            stream = self._streams.get(ev.stream_id)
            if stream is None:
                with contextlib.suppress(MuxError):
                    self.session.consume(ev.stream_id, len(ev.data))  # for a stream we already retired
            else:
                stream.data.append(ev.data)
        elif isinstance(ev, StreamHalfClosed):
            if (stream := self._streams.get(ev.stream_id)) is not None:
                stream.eof = True
        elif isinstance(ev, (StreamReset, StreamClosed)):
            if (stream := self._streams.get(ev.stream_id)) is not None:
                stream.eof = True
                stream.reset = isinstance(ev, StreamReset)
        elif isinstance(ev, SessionEnding):
            self.ended = True
        # StreamOpened: the guest opens none; WindowOpened: writers wake on notify_all

    def _write_loop(self) -> None:
        assert self._chan is not None
        while True:
            with self._cv:
                while not self.session.pending_output and not self.ended:
                    self._cv.wait()
                out = self.session.data_to_send()
                finished = self.ended
            if out:
                try:
                    self._chan.sendall(out)
                except OSError as exc:
                    self._end(exc)
                    return
            if finished and not out:
                return

    def _end(self, error: BaseException | None, flush_s: float = 0.0) -> None:
        with self._cv:
            if self.error is None:
                self.error = error
            self.ended = True
            self._cv.notify_all()
        if flush_s and self._chan is not None:
            deadline = time.monotonic() + flush_s
            while self.session.pending_output and time.monotonic() < deadline:
                time.sleep(0.01)
        if self._chan is not None:
            with contextlib.suppress(OSError):
                self._chan.shutdown(socket.SHUT_RDWR)
            self._chan.close()
