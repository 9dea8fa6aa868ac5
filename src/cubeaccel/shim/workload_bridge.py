"""The host end of the workload channel: each connection on the sandbox's `workload.sock` becomes one mux stream.

The VMM's workload virtserialport is a unix socket (`workload-vmm.sock`, in the state dir); the shim is its only
client. It writes the token preamble (`protocol.mux.token_preamble`), then runs the host side of the mux session
(`protocol.mux.Session`, client: odd stream ids). `workload.sock` (0600, the state dir) is what Cubelet's proxy and
tests connect to; every accepted connection is opened as a stream and pumped both ways.

Bounds: what a slow client has not read is at most one window per stream (the guest waits for credit), and what
a slow guest has not credited stays in the client's socket (we read from a client only when the stream has
credit). One reader thread feeds the session and never writes; one writer thread is the only one to write to the
VMM socket; per stream, one thread each way. Streams are capped at the session's `max_streams`. Streams the guest
opens are refused (RESET): the guest serves, it never calls.

Recovery: a session ends when the guest breaks a framing rule or floods, when the VMM socket closes, or when the
guest service restarts (it sends GOAWAY first, `workload/__main__.announce_restart`). Then every open stream's
client sees its connection closed, and a supervisor thread reconnects to the VMM socket, writes the preamble again
and probes `GET /health`, backing off between tries (`RECONNECT_PAUSE_S`, doubling to `RECONNECT_MAX_S`); new
connections wait for it up to `OPEN_WAIT_S`. Each session has its own reader and writer threads bound to its own
socket and `Session`, so a stale thread never touches the new one.

Liveness: a guest whose service died without a restart (the OOM killer took it, or init could not restart it)
closes nothing — a virtio port shows the host no close — so its calls would wait forever. A watchdog PINGs the
channel every `PING_EVERY_S`; a PING unanswered for `UNRESPONSIVE_AFTER_S` (stretched with the host's load) ends
the session as `workload.unresponsive` and tells the shim (`on_health`), which reports it. Until a reconnect
answers `/health` again, every new connection is answered at once with a 503 naming that code, instead of
waiting: the tenant reads why, and nothing hangs.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from cubeaccel.host.service.unix_path import connect_path
from cubeaccel.protocol.errors import CubeError
from cubeaccel.protocol.mux import (
    DataReceived,
    Frame,
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
    token_preamble,
)
from cubeaccel.shim.load_scale import host_deadline_scale

CHUNK = 64 * 1024
RECONNECT_PAUSE_S = 0.5  # first pause after a session ends: the guest must see the host side go away (EOF)
RECONNECT_MAX_S = 5.0
RECONNECT_HEALTH_S = 10.0  # a new session that does not answer /health within this is dropped and retried
OPEN_WAIT_S = 15.0  # how long a new connection waits for a reconnect in progress
HANDOVER_ACK_S = 5.0  # an in-place rebind whose GOAWAY+PING is not answered within this reconnects instead
HEALTH_REQUEST = b"GET /health HTTP/1.1\r\nHost: workload\r\nConnection: close\r\n\r\n"
PING_EVERY_S = 5.0  # the watchdog's PING on a live session
UNRESPONSIVE_AFTER_S = 20.0  # an unanswered PING this old (times the host's load stretch): the service is gone
HealthListener = Callable[[bool, str], None]  # (answering, why): told when the service stops or starts answering


def _ignore_health(_answering: bool, _why: str) -> None:
    pass


def workload_error(code: str, message: str, **details: object) -> CubeError:
    return CubeError(code, message, layer="workload", details=dict(details), status=502)


@dataclass
class _Handover:
    """An in-place rebind in progress on `session`'s channel: the guest answers `ping` once its reader has taken
    our GOAWAY (both came in one read, the GOAWAY first), and reads nothing more of that session."""

    session: Session
    ping: int
    answered: bool = False
    failed: bool = False


@dataclass
class _Stream:
    sid: int
    session: Session  # the session it belongs to: ids start again in a new one
    data: deque[bytes] = field(default_factory=deque)
    eof: bool = False
    reset: bool = False
    write_closed: bool = False


class WorkloadBridge:
    def __init__(
        self,
        vmm_socket: Path,
        listen: Path,
        token: str,
        config: MuxConfig | None = None,
        on_health: HealthListener = _ignore_health,
        unresponsive_after_s: float = UNRESPONSIVE_AFTER_S,
        ping_every_s: float = PING_EVERY_S,
    ) -> None:
        self.vmm_socket = vmm_socket
        self.listen_path = listen
        self._preamble = token_preamble(token)
        self._config = config or MuxConfig()
        self.session = Session(client=True, config=self._config)
        self._cv = threading.Condition()
        self._streams: dict[int, _Stream] = {}
        self._chan: socket.socket | None = None
        self._listener: socket.socket | None = None
        self.ended = False
        self.error: BaseException | None = None
        self.connections = 0  # accepted so far (tests, reports)
        self.sessions = 0  # sessions started, the first included (tests, reports)
        self.reconnect = True  # after start(): a session that ends is replaced (see the module docstring)
        self._closing = False
        self._reconnecting = False
        self._reader_alive = False  # the current session's reader still runs
        self._writer: threading.Thread | None = None  # the current session's writer
        self._handover: _Handover | None = None  # an in-place rebind waiting for the guest's answer
        self.in_place_rebinds = 0  # rebinds done without reconnecting (tests, reports)
        self._on_health = on_health
        self.unresponsive_after_s = unresponsive_after_s
        self.ping_every_s = ping_every_s
        self._ping: tuple[Session, int, float] | None = None  # the watchdog's PING awaiting its answer
        self.unresponsive_since: float | None = None  # the service stopped answering; None: it answers
        self._armed = False  # the service answered /health once: from then on its silence means it is gone

    # ---- lifecycle -----------------------------------------------------------------------------------------
    def start(self, timeout_s: float = 10.0) -> None:
        """Connect to the VMM's port, send the token, start pumping, then listen on `workload.sock`."""
        self._connect(timeout_s)
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
        threading.Thread(target=self._supervise, daemon=True, name="workload reconnect").start()
        threading.Thread(target=self._watch, daemon=True, name="workload watchdog").start()

    def _connect(self, timeout_s: float) -> None:
        """A new session: connect (retrying until `timeout_s`), preamble, a reader and a writer for it."""
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
        self._begin(chan)

    def _begin(self, chan: socket.socket) -> None:
        """Preamble, then a new session on `chan` with its own reader and writer."""
        try:
            chan.sendall(self._preamble)
        except OSError as e:
            chan.close()
            raise workload_error("workload.channel_unreachable", f"workload port socket: {e}") from e
        session = Session(client=True, config=self._config)
        writer = threading.Thread(
            target=self._write_loop, args=(chan, session), daemon=True, name="workload mux writer"
        )
        with self._cv:
            if self._closing:
                chan.close()
                raise workload_error("workload.channel_closed", "the bridge is closing")
            if self._chan is not None and self._chan is not chan:
                self._chan.close()  # the ended session's socket (its threads have returned or will)
            self._chan, self.session, self._writer = chan, session, writer
            self._streams.clear()
            self.ended, self.error = False, None
            self._reader_alive = True
            self.sessions += 1
            self._cv.notify_all()
        threading.Thread(target=self._read_loop, args=(chan, session), daemon=True, name="workload mux reader").start()
        writer.start()

    def _supervise(self) -> None:
        """Replace a session that ended (not by close()) with a new one that answers /health."""
        pause = RECONNECT_PAUSE_S
        while True:
            with self._cv:
                while not (self.ended or self._closing) or (self._handover is not None and not self._closing):
                    self._cv.wait()
                if self._closing or not self.reconnect:
                    return
                self._reconnecting = True
            time.sleep(pause)  # the guest must see the host side go away before it comes back
            try:
                self._connect(RECONNECT_MAX_S)
                took = self.wait_healthy(RECONNECT_HEALTH_S, cancelled=lambda: self._closing)
                pause = RECONNECT_PAUSE_S
                with self._cv:
                    self._reconnecting = False
                    was = self.unresponsive_since
                    self.unresponsive_since = None
                    self._cv.notify_all()
                if was is not None:
                    self._on_health(True, f"answering again after {time.monotonic() - was:.1f} s ({took:.1f} s)")
            except CubeError:
                pause = min(pause * 2, RECONNECT_MAX_S)
                with self._cv:
                    if not self._closing and not self.ended:
                        self._drop_session(workload_error("workload.not_up", "no answer after reconnecting"))

    def rebind(self, token: str, timeout_s: float) -> None:
        """Serve `token` from now on (a warm sandbox's claim): the current session ends (its clients see their
        connections closed), a new one starts with the new preamble, and this returns once the guest answers
        `/health` in it — every request after it is judged against the new token.

        In place first (`_rebind_in_place`: no reconnect, so no pause for the guest to see the host go away);
        where that does not finish, the supervisor reconnects with the new preamble."""
        preamble = token_preamble(token)
        deadline = time.monotonic() + timeout_s
        with self._cv:
            before = self.sessions
        if self._rebind_in_place(preamble, deadline):
            return
        with self._cv:
            self._preamble = preamble
            if not self.ended:  # (an in-place try that failed has ended it: the supervisor is on it)
                self._drop_session(None)
            while self.sessions == before or self._reconnecting or self.ended:
                left = deadline - time.monotonic()
                if left <= 0 or self._closing:
                    raise workload_error("workload.not_up", f"no session under the new token within {timeout_s:.0f} s")
                self._cv.wait(left)

    def _rebind_in_place(self, preamble: bytes, deadline: float) -> bool:
        """End the session and start the next on the same connection. The guest's service reads its channel in
        chunks and stops reading a session at the chunk holding its GOAWAY, then reads the next preamble from
        the channel a byte at a time (skipping what precedes it); so GOAWAY and a PING go in one write, and the
        guest's answer to the PING proves its session reader took the GOAWAY and stopped. Only then is the new
        preamble sent: no byte of it can be read as a frame of the old session. False (nothing sent after the
        GOAWAY, the session ended) where the guest does not answer or the new session does not answer /health:
        the caller reconnects, which a guest serves in every case."""
        with self._cv:
            if self.ended or self._reconnecting or self._closing or self._chan is None or not self._reader_alive:
                return False
            chan, writer = self._chan, self._writer
            handover = _Handover(self.session, secrets.randbits(32))
            self._handover, self._preamble = handover, preamble
            self.ended = self._reconnecting = True  # the old session's clients see their streams end; new ones wait
            self._cv.notify_all()
        try:
            if writer is not None:
                writer.join(max(0.0, min(HANDOVER_ACK_S, deadline - time.monotonic())))  # it drains and returns
                if writer.is_alive():
                    return self._handover_failed(handover)
            goaway = Frame(FrameType.RESET, 0, length=ResetCode.GOING_AWAY).encode()
            chan.sendall(goaway + Frame(FrameType.PING, 0, length=handover.ping).encode())
            ack_by = min(deadline, time.monotonic() + HANDOVER_ACK_S)
            with self._cv:
                while not (handover.answered or handover.failed or self._closing):
                    left = ack_by - time.monotonic()
                    if left <= 0:
                        break
                    self._cv.wait(left)
                if not handover.answered:
                    return self._handover_failed(handover)
            self._begin(chan)
            with self._cv:
                self._handover = None  # only now: the supervisor must never see the old session ended without it
            self.wait_healthy(
                max(0.1, min(RECONNECT_HEALTH_S, deadline - time.monotonic())), cancelled=lambda: self._closing
            )
        except (OSError, CubeError):
            with self._cv:
                self._handover = None
                self._drop_session(None)
            return False
        with self._cv:
            self._reconnecting = False
            self.in_place_rebinds += 1
            self._cv.notify_all()
        return True

    def _handover_failed(self, handover: _Handover) -> bool:
        with self._cv:
            handover.failed = True
            if self._handover is handover:
                self._handover = None
            self._reconnecting = False  # the supervisor's reconnect takes over
            self._drop_session(None)
        return False

    def wait_healthy(self, timeout_s: float, cancelled: Callable[[], bool] = lambda: False) -> float:
        """Until the guest service answers `GET /health` over the channel; seconds it took. The service is up
        when it answers, so a start whose service never comes up fails here (`workload.not_up`, layer guest)."""
        t0 = time.monotonic()
        result: list[bytes] = []

        def probe() -> None:
            with contextlib.suppress(OSError, CubeError):
                result.append(self.request(HEALTH_REQUEST, wait=False))

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
        with self._cv:
            self._armed = True  # (a guest still booting answers no PING: the watchdog waits for this)
        return time.monotonic() - t0

    def request(self, raw: bytes, limit: int = 64 * 1024, wait: bool = True) -> bytes:
        """One request on a fresh stream; the whole reply until the guest closes (at most `limit` bytes).
        `wait=False`: do not wait for a reconnect in progress (the reconnect's own probe)."""
        stream = self._open(wait)
        try:
            self._send_all(stream, raw)
            self._half_close(stream)
            out = bytearray()
            while len(out) < limit and (chunk := self._recv(stream)):
                out += chunk
            return bytes(out)
        finally:
            self._retire(stream)

    def close(self) -> None:
        with self._cv:
            self._closing = True
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
    def _open(self, wait: bool = True) -> _Stream:
        with self._cv:
            if wait and self.unresponsive_since is not None:  # known gone: no wait for a reconnect that may not come
                raise self._unresponsive_error()
            deadline = time.monotonic() + OPEN_WAIT_S
            while wait and (self.ended or self._reconnecting) and not self._closing and self.reconnect:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(left)
            if self.ended:
                raise workload_error("workload.channel_closed", f"workload channel ended: {self.error}")
            sid = self.session.open_stream()
            stream = self._streams[sid] = _Stream(sid, self.session)
            self._cv.notify_all()
            return stream

    def _live(self, stream: _Stream) -> bool:
        return stream.session is self.session and not self.ended and self._streams.get(stream.sid) is stream

    def _send_all(self, stream: _Stream, data: bytes) -> None:
        view = memoryview(data)
        while view:
            with self._cv:
                while True:
                    if not self._live(stream) or stream.reset or stream.write_closed:
                        raise BrokenPipeError("workload stream closed")
                    window = self.session.send_window(stream.sid)
                    if window > 0:
                        n = self.session.send(stream.sid, bytes(view[:window]))
                        self._cv.notify_all()
                        break
                    self._cv.wait()
            view = view[n:]

    def _wait_credit(self, stream: _Stream) -> int:
        with self._cv:
            while True:
                if not self._live(stream) or stream.reset:
                    return 0
                window = self.session.send_window(stream.sid)
                if window > 0:
                    return window
                self._cv.wait()

    def _half_close(self, stream: _Stream) -> None:
        with self._cv:
            if self._live(stream) and not stream.write_closed:
                stream.write_closed = True
                with contextlib.suppress(MuxError):
                    self.session.close(stream.sid)
                self._cv.notify_all()

    def _recv(self, stream: _Stream) -> bytes:
        """Next data of the stream (credit returned at once: the caller has taken it), b"" at its end."""
        with self._cv:
            while True:
                live = self._live(stream)
                if stream.data:  # what arrived before a session ended is still the client's
                    chunk = stream.data.popleft()
                    if live:
                        with contextlib.suppress(MuxError):
                            self.session.consume(stream.sid, len(chunk))
                        self._cv.notify_all()
                    return chunk
                draining = not live and stream.session is self.session and self._reader_alive
                if (not live and not draining) or stream.eof or stream.reset:
                    return b""
                self._cv.wait()  # (draining: the writer failed; the reader still delivers what had come)

    def _retire(self, stream: _Stream) -> None:
        with self._cv:
            if self._live(stream):
                del self._streams[stream.sid]
                with contextlib.suppress(MuxError):
                    if not stream.eof or not stream.write_closed:
                        self.session.reset(stream.sid, ResetCode.CANCEL)  # the client went away before the end
                    if stream.data:
                        self.session.consume(stream.sid, sum(len(d) for d in stream.data))
            elif self._streams.get(stream.sid) is stream:
                del self._streams[stream.sid]
            stream.data.clear()
            self._cv.notify_all()

    # ---- threads -------------------------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        assert self._listener is not None
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(client,), daemon=True, name="workload conn").start()

    def _serve(self, client: socket.socket) -> None:
        try:
            stream = self._open()  # may wait for a reconnect in progress
        except CubeError as e:
            if e.code == "workload.unresponsive":
                _answer_error(client, e)  # the caller reads why
            client.close()  # channel gone: the caller sees a closed connection
            return
        except MuxError:
            client.close()  # too many streams: the caller sees a closed connection
            return
        up = threading.Thread(target=self._up, args=(client, stream), daemon=True, name=f"workload {stream.sid} up")
        up.start()
        try:
            while chunk := self._recv(stream):
                client.sendall(chunk)
            with contextlib.suppress(OSError):
                client.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        finally:
            if not self._live(stream):
                with contextlib.suppress(OSError):
                    client.shutdown(socket.SHUT_RDWR)  # wakes our reader of the client
            up.join(30)
            self._retire(stream)
            client.close()

    def _up(self, client: socket.socket, stream: _Stream) -> None:
        try:
            while (window := self._wait_credit(stream)) > 0:
                data = client.recv(min(CHUNK, window))
                if not data:
                    break
                self._send_all(stream, data)
        except OSError:
            pass
        finally:
            self._half_close(stream)

    def _read_loop(self, chan: socket.socket, session: Session) -> None:
        error: BaseException | None = None
        while True:
            try:
                data = chan.recv(CHUNK)
            except OSError as exc:
                error = exc
                break
            with self._cv:
                handover = self._handover
                if handover is not None and handover.session is session:
                    self._take_handover_reply(handover, data)
                    if handover.answered or handover.failed:
                        return  # the guest reads nothing more of this session, nor do we
                    continue
                if session is not self.session:
                    return  # a newer session replaced ours
                try:
                    events = session.receive(data) if data else session.receive_eof()
                except MuxError as err:
                    with contextlib.suppress(MuxError):
                        session.go_away(ResetCode.PROTOCOL)
                    error = err
                    events = []
                for ev in events:
                    self._apply(ev)
                self._cv.notify_all()
                if not data or error is not None or session.closed:
                    break
        if error is None:
            error = workload_error("workload.channel_closed", "the guest closed the channel")
        with self._cv:
            if session is self.session:
                self._reader_alive = False
                self._drop_session(error)

    def _take_handover_reply(self, handover: _Handover, data: bytes) -> None:
        """What the guest sends during an in-place rebind (lock held): the end of the old session's output, then
        the answer to our PING."""
        try:
            events = handover.session.receive(data) if data else None
        except MuxError:
            events = None
        if events is None:
            handover.failed = True
        elif any(isinstance(ev, PingAnswered) and ev.value == handover.ping for ev in events):
            handover.answered = True
        self._cv.notify_all()

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
        elif isinstance(ev, PingAnswered):
            if self._ping is not None and self._ping[1] == ev.value:
                self._ping = None  # the service's reader answered: it is alive
        elif isinstance(ev, StreamOpened):
            with contextlib.suppress(MuxError):
                self.session.reset(ev.stream_id, ResetCode.REFUSED)  # the guest serves; it opens nothing
        # WindowOpened: writers wake on notify_all

    def _write_loop(self, chan: socket.socket, session: Session) -> None:
        while True:
            with self._cv:
                while not session.pending_output and not self.ended and session is self.session:
                    self._cv.wait()
                if session is not self.session:
                    return
                out = session.data_to_send()
                finished = self.ended
            if out:
                try:
                    chan.sendall(out)
                except OSError as exc:
                    with self._cv:
                        if session is self.session:  # the reader still delivers what the guest sent before
                            self._drop_session(exc, how=socket.SHUT_WR)
                    return
            if finished and not out:
                return

    def _watch(self) -> None:
        """PING the live session every `ping_every_s`; one unanswered for `unresponsive_after_s` (stretched with
        the host's load) ends it as `workload.unresponsive`."""
        while True:
            with self._cv:
                wake = time.monotonic() + self.ping_every_s
                while not self._closing and (left := wake - time.monotonic()) > 0:
                    self._cv.wait(left)
                if self._closing:
                    return
                silent = self._check_liveness(time.monotonic())
            if silent is not None:
                self._on_health(False, f"no answer on the workload channel for {silent:.0f} s")

    def _check_liveness(self, now: float) -> float | None:
        """(Lock held.) Send the next PING, or judge the one outstanding; the seconds of silence when the service
        is found gone."""
        if not self._armed or self.ended or self._reconnecting or self._handover is not None or not self._reader_alive:
            self._ping = None  # no live session to judge (the supervisor's /health probe judges a new one)
            return None
        if self._ping is not None and self._ping[0] is self.session:
            silent = now - self._ping[2]
            if silent <= self.unresponsive_after_s * host_deadline_scale():
                return None
            self._ping = None
            self.unresponsive_since = now
            self._drop_session(self._unresponsive_error(silent))
            return silent
        with contextlib.suppress(MuxError):
            self._ping = (self.session, self.session.ping(), now)
            self._cv.notify_all()  # the writer sends it
        return None

    def _unresponsive_error(self, silent: float | None = None) -> CubeError:
        since = self.unresponsive_since
        silent = silent if silent is not None else (time.monotonic() - since if since is not None else 0.0)
        return CubeError(
            "workload.unresponsive",
            "the sandbox's workload service stopped answering (the guest may be out of memory); "
            "calls fail until it answers again",
            layer="workload",
            details={"silent_s": round(silent, 1)},
            status=503,
        )

    def _drop_session(self, error: BaseException | None, how: int = socket.SHUT_RDWR) -> None:
        """End the current session (called with the lock held): clients see their connections closed."""
        if self.error is None:
            self.error = error
        self.ended = True
        self._cv.notify_all()
        if self._chan is not None:
            with contextlib.suppress(OSError):
                self._chan.shutdown(how)

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


def _answer_error(client: socket.socket, err: CubeError) -> None:
    """An HTTP response naming `err` on a connection no stream was opened for (its request is left unread)."""
    body = json.dumps(err.to_json()).encode()
    head = (
        f"HTTP/1.1 {err.status} Service Unavailable\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    with contextlib.suppress(OSError):
        client.settimeout(5.0)
        client.sendall(head.encode() + body)
        client.shutdown(socket.SHUT_WR)
