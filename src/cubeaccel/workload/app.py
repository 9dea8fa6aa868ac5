"""Routing, authentication and the Connect handlers: one `Workload` serves every connection.

Authentication follows envd (internal/api/auth.go): `GET /health` is open; every RPC needs `X-Access-Token`;
`/files` accepts the token or envd's signed URL (`signature=v1_<base64 sha256(path:op:user:token[:exp])>`).
Tokens are compared with `hmac.compare_digest` and never logged.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import signal
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from cubeaccel.protocol.envd_filesystem import (
    CreateWatcherResponse,
    GetWatcherEventsResponse,
    ListDirRequest,
    MoveRequest,
    PathRequest,
    UploadedEntry,
    WatchDirResponse,
    WatcherRequest,
    WatchRequest,
)
from cubeaccel.protocol.envd_process import (
    DataEvent,
    EndEvent,
    KeepAlive,
    ListResponse,
    ProcessEvent,
    ProcessInput,
    ProcessRequest,
    SendInputRequest,
    SendSignalRequest,
    StartEvent,
    StartRequest,
    StreamInputRequest,
    UpdateRequest,
)
from cubeaccel.protocol.guest_metrics import MetricsSeries
from cubeaccel.protocol.proto_json import Empty, Json, ProtoJsonError
from cubeaccel.workload import ENVD_VERSION
from cubeaccel.workload import connect as c
from cubeaccel.workload import files as fs
from cubeaccel.workload.connect import ConnectError
from cubeaccel.workload.http1 import HttpError, Request, Response, log
from cubeaccel.workload.metrics import Sampler, pci_devices
from cubeaccel.workload.portforward import PORT_PREFIX, forward
from cubeaccel.workload.process import SIGNAL_ENUM, Process, ProcessTable, Subscriber
from cubeaccel.workload.users import User, expand_and_resolve, lookup
from cubeaccel.workload.watch import Watcher, WatcherTable, watch_path_checks

MAX_UNARY_BODY = 4 * 1024 * 1024  # SendInput carries stdin (base64): sizeable, but bounded per connection
DEFAULT_KEEPALIVE_S = 90.0  # envd's default when Keepalive-Ping-Interval is absent
METRICS_SERIES = "/cubeaccel/metrics"  # ours: the hour of samples the guest keeps, and the PCI devices it sees
DEADLINE_EXCEEDED = ConnectError("deadline_exceeded", "context deadline exceeded")  # Go's ctx.Err() text


# Anything a unary handler returns (`to_json`); wire/base.Reply is the host's pydantic reply base.
class Reply(Protocol):
    def to_json(self) -> dict[str, object]: ...


Unary = Callable[["Workload", Json, User], Reply]
R = TypeVar("R")


@dataclass
class Workload:
    token: bytes
    default_user: str
    default_workdir: str | None = None
    processes: ProcessTable = field(default_factory=ProcessTable)
    watchers: WatcherTable = field(default_factory=WatcherTable)
    metrics: Sampler = field(default_factory=Sampler)

    def __post_init__(self) -> None:
        if not self.token:
            raise ValueError("an access token is required")
        self.processes.default_workdir = self.default_workdir

    # ---- entry point ---------------------------------------------------------------------------------------
    def __call__(self, request: Request, response: Response) -> None:
        route = request.path
        if route == "/health" and request.method in ("GET", "HEAD"):
            response.send(204, [("X-Envd-Version", ENVD_VERSION)])
            return
        if route in ("/metrics", METRICS_SERIES) and request.method == "GET":
            if not self._token_ok(request):
                raise HttpError(401, "unauthorized access, please provide a valid access token")
            if route == "/metrics":  # envd's: the newest sample
                response.send_json(200, self.metrics.latest().to_json())
            else:
                series = MetricsSeries(self.metrics.series(), tuple(pci_devices()))
                response.send_json(200, series.to_json())
            return
        if route.startswith(PORT_PREFIX):
            if not self._token_ok(request):
                raise HttpError(401, "unauthorized access, please provide a valid access token")
            forward(request, response)
            return
        if route == "/files":
            if request.method == "GET":
                self._download(request, response)
            elif request.method == "POST":
                self._upload(request, response)
            else:
                response.send_json(405, {"code": 405, "message": "method not allowed"})
            return
        name = route.lstrip("/")
        if name in UNARY or name in STREAMING or name == CLIENT_STREAMING or name.split("/", 1)[0] in SERVICES:
            self._rpc(name, request, response)
            return
        response.send_json(404, {"code": 404, "message": f"no route {route}"})

    # ---- authentication ------------------------------------------------------------------------------------
    def _token_ok(self, request: Request) -> bool:
        given = request.header("X-Access-Token").encode("utf-8", "surrogateescape")
        return hmac.compare_digest(given, self.token)

    def _signature_ok(self, request: Request, operation: str) -> str | None:
        """None if the request is authorised for `operation` on /files, else envd's reason."""
        if request.header("X-Access-Token"):
            return None if self._token_ok(request) else "access token present in header but does not match"
        signature = request.param("signature")
        if signature is None:
            return "unauthorized access, please provide a valid access token or method signing if supported"
        expiration = request.param("signature_expiration")
        fields = [request.param("path") or "", operation, request.param("username") or "", self.token.decode()]
        if expiration is not None:
            fields.append(expiration)
        digest = hashlib.sha256(":".join(fields).encode()).digest()
        expected = "v1_" + base64.b64encode(digest).decode().rstrip("=")
        if not hmac.compare_digest(expected.encode(), signature.encode("utf-8", "surrogateescape")):
            return "invalid signature"
        if expiration is not None:
            try:
                if int(expiration) < time.time():
                    return "signature is already expired"
            except ValueError:
                return "invalid signature expiration"
        return None

    def _rpc_user(self, request: Request) -> User:
        """Basic auth names the user (`user:`), else the default user (envd permissions.GetAuthUser)."""
        name = self.default_user
        auth = request.header("Authorization")
        if auth.lower().startswith("basic "):
            try:
                name = base64.b64decode(auth[6:].strip(), validate=True).decode().split(":", 1)[0]
            except (binascii.Error, UnicodeDecodeError, ValueError):
                raise ConnectError("unauthenticated", "invalid basic auth header") from None
        try:
            return lookup(name)
        except KeyError:
            raise ConnectError("unauthenticated", f"invalid username: '{name}'") from None

    # ---- Connect -------------------------------------------------------------------------------------------
    def _rpc(self, name: str, request: Request, response: Response) -> None:
        if request.method != "POST":
            response.send_json(405, {"code": "unimplemented", "message": "Connect calls are POST"})
            return
        ctype = request.header("Content-Type").split(";")[0].strip().lower()
        if name in STREAMING or name == CLIENT_STREAMING or ctype.startswith("application/connect+"):
            self._stream(name, ctype, request, response)
        else:
            self._unary(name, ctype, request, response)

    def _unary(self, name: str, ctype: str, request: Request, response: Response) -> None:
        if ctype != "application/json":
            response.send(415, [("Accept-Post", "application/json, application/connect+json")])
            return
        try:
            if not self._token_ok(request):
                raise ConnectError("unauthenticated", "missing or wrong access token")
            handler = UNARY.get(name)
            if handler is None:
                raise ConnectError("unimplemented", f"{name} is not implemented")
            body = request.body.read_all(MAX_UNARY_BODY)
            reply = handler(self, c.parse_message(body), self._rpc_user(request))
        except ProtoJsonError as err:
            invalid = c.invalid(err)
            response.send_json(invalid.http_status, invalid.to_json())
            return
        except HttpError as err:
            error = ConnectError("resource_exhausted" if err.status == 413 else "invalid_argument", str(err))
            response.keep_alive = False
            response.send_json(error.http_status, error.to_json())
            return
        except ConnectError as err:
            response.send_json(err.http_status, err.to_json())
            return
        except Exception as exc:  # a bug or an unexpected OS error: still a Connect error, and keep serving
            internal = _internal(name, exc)
            response.send_json(internal.http_status, internal.to_json())
            return
        response.send_json(200, reply.to_json())

    def _stream(self, name: str, ctype: str, request: Request, response: Response) -> None:
        headers = [("Content-Type", "application/connect+json")]
        if ctype != "application/connect+json":
            response.send(415, [("Accept-Post", "application/json, application/connect+json")])
            return
        if name == CLIENT_STREAMING:
            self._client_stream(request, response)
            return
        try:
            if not self._token_ok(request):
                raise ConnectError("unauthenticated", "missing or wrong access token")
            if name not in STREAMING:
                raise ConnectError("unimplemented", f"{name} is not implemented")
            if request.header("Connect-Content-Encoding", "identity").lower() != "identity":
                raise ConnectError("unimplemented", "compressed requests are not supported")
            message = self._read_envelope(request)
            user = self._rpc_user(request)
            timeout_s = _timeout(request)
            # connect-go gives the handler a context with the call's deadline; envd's stream ends with it
            deadline = None if timeout_s is None else time.monotonic() + timeout_s
            if name == WATCH_DIR:
                watcher = self._open_watch(WatchRequest.from_json(message), user)
            elif name == "process.Process/Start":
                proc, sub = self.processes.start(StartRequest.from_json(message), user, timeout_s)
            else:
                proc = self.processes.find(ProcessRequest.from_json(message).process, include_ended=True)
                sub = proc.subscribe()
        except Exception as exc:
            failure = _as_connect_error(name, exc)
            response.start_chunked(200, headers)
            response.chunk(c.end_stream(failure))
            response.end()
            return
        if name == WATCH_DIR:
            try:
                response.start_chunked(200, headers)
                response.chunk(c.encode_envelope(WatchDirResponse("start").to_json()))
                outcome = self._relay_watch(watcher, _keepalive(request), response, deadline)
                response.chunk(c.end_stream(outcome))
                response.end()
            finally:
                self.watchers.close_stream(watcher)
            return
        try:
            response.start_chunked(200, headers)
            response.chunk(c.encode_envelope(ProcessEvent(StartEvent(proc.pid)).to_json()))
            ended = self._relay(sub, _keepalive(request), response, deadline)
            response.chunk(c.end_stream(None if ended else DEADLINE_EXCEEDED))
            response.end()
        finally:
            proc.unsubscribe(sub)

    def _client_stream(self, request: Request, response: Response) -> None:
        """StreamInput: envelopes applied in arrival order (start, data..., keepalive); one reply at the end."""
        try:
            if not self._token_ok(request):
                raise ConnectError("unauthenticated", "missing or wrong access token")
            decoder = c.EnvelopeDecoder()
            proc: Process | None = None
            while True:
                try:
                    data = request.body.read(65536)
                except HttpError as err:
                    raise ConnectError("invalid_argument", str(err)) from None
                if not data:
                    decoder.finish()
                    break
                for env in decoder.feed(data):
                    if env.flags & c.FLAG_COMPRESSED:
                        raise ConnectError("unimplemented", "compressed messages are not supported")
                    msg = StreamInputRequest.from_json(env.message())
                    if msg.kind == "start":
                        proc = self.processes.find(msg.process)
                    elif msg.kind == "data":
                        if proc is None:
                            raise ConnectError("failed_precondition", "input before the start event")
                        _input(proc, msg.input or ProcessInput())
                    elif msg.kind is None:
                        raise ConnectError("unimplemented", "invalid event type")
        except Exception as exc:
            failure = _as_connect_error(CLIENT_STREAMING, exc)
            response.keep_alive = response.keep_alive and request.body.done
            response.start_chunked(200, [("Content-Type", "application/connect+json")])
            response.chunk(c.end_stream(failure))
            response.end()
            return
        response.start_chunked(200, [("Content-Type", "application/connect+json")])
        response.chunk(c.encode_envelope(Empty().to_json()))
        response.chunk(c.end_stream())
        response.end()

    @staticmethod
    def _read_envelope(request: Request) -> dict[str, object]:
        try:
            head = request.body.read_exact(c.ENVELOPE.size)
            if len(head) < c.ENVELOPE.size:
                raise ConnectError("invalid_argument", "request envelope missing")
            flags, length = c.ENVELOPE.unpack(head)
            if flags & c.FLAG_COMPRESSED:
                raise ConnectError("unimplemented", "compressed messages are not supported")
            if length > c.DEFAULT_MAX_MESSAGE:
                raise ConnectError("resource_exhausted", f"request message of {length} bytes is too large")
            payload = request.body.read_exact(length)
            if len(payload) < length:
                raise ConnectError("invalid_argument", "request envelope cut short")
            if request.body.read(1):
                raise ConnectError("invalid_argument", "a server-streaming call takes exactly one request message")
        except HttpError as err:
            raise ConnectError("invalid_argument", str(err)) from None
        return c.parse_message(payload)

    def _open_watch(self, message: WatchRequest, user: User) -> Watcher:
        path = _path(self, message.path, user)
        watch_path_checks(path, message.allow_network_mounts)
        return self.watchers.open_stream(path, message.recursive, message.include_entry)

    @staticmethod
    def _relay_watch(
        watcher: Watcher, keepalive_s: float, response: Response, deadline: float | None
    ) -> ConnectError | None:
        """Filesystem events as they come, a keepalive after `keepalive_s` without one, until the deadline
        (`deadline_exceeded`), the watch fails (its error) or the caller goes away (a write raises)."""
        quiet_since = time.monotonic()
        while True:
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return DEADLINE_EXCEEDED
            wait = keepalive_s - (now - quiet_since)
            if deadline is not None:
                wait = min(wait, deadline - now)
            try:
                events = watcher.take(max(0.0, wait))
            except ConnectError as err:
                return err
            for event in events:
                response.chunk(c.encode_envelope(WatchDirResponse("filesystem", event).to_json()))
            if events:
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since >= keepalive_s:
                response.chunk(c.encode_envelope(WatchDirResponse("keepalive").to_json()))
                quiet_since = time.monotonic()

    @staticmethod
    def _relay(sub: Subscriber, keepalive_s: float, response: Response, deadline: float | None) -> bool:
        """Output events until the end event (True), or until the call's deadline passes first (False: the
        stream then ends as envd's does, `deadline_exceeded`, and the command's own timer kills it); a keepalive
        after `keepalive_s` without one (envd resets it on data)."""
        while True:
            wait = keepalive_s
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                wait = min(wait, left)
            item: DataEvent | EndEvent | KeepAlive | None = sub.get(wait)
            if item is None:
                if deadline is not None and time.monotonic() >= deadline:
                    return False
                item = KeepAlive()
            response.chunk(c.encode_envelope(ProcessEvent(item).to_json()))
            if isinstance(item, EndEvent):
                return True

    # ---- /files --------------------------------------------------------------------------------------------
    def _files_user(self, request: Request) -> User:
        name = request.param("username") or self.default_user
        try:
            return lookup(name)
        except KeyError:
            raise HttpError(401, f"error looking up user '{name}': user: unknown user {name}") from None

    def _files_path(self, request: Request, user: User) -> str:
        try:
            return expand_and_resolve(request.param("path") or "", user, self.default_workdir)
        except ConnectError as err:
            raise HttpError(400, f"error expanding and resolving path: {err.message}") from None

    def _download(self, request: Request, response: Response) -> None:
        reason = self._signature_ok(request, "read")
        if reason is not None:
            raise HttpError(401, reason)
        path = self._files_path(request, self._files_user(request))
        size, f, ctype = fs.open_download(path)
        name = path.rsplit("/", 1)[-1].replace('"', "")
        headers = [("Content-Disposition", f'inline; filename="{name}"'), ("Vary", "Accept-Encoding")]
        with f:
            if _accepts_gzip(request.header("Accept-Encoding")):
                response.start_chunked(200, [("Content-Type", ctype), ("Content-Encoding", "gzip"), *headers])
                deflater = zlib.compressobj(1, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
                while piece := f.read(fs.PIECE):
                    response.chunk(deflater.compress(piece))
                response.chunk(deflater.flush())
                response.end()
                return
            response.start_fixed(200, [("Content-Type", ctype), *headers], size)
            sent = 0
            while sent < size and (piece := f.read(min(fs.PIECE, size - sent))):
                response.write(piece)
                sent += len(piece)
            if sent < size:  # the file shrank under us: the length we promised cannot be kept
                response.keep_alive = False
                raise ConnectionError("file shrank during download")

    def _upload(self, request: Request, response: Response) -> None:
        reason = self._signature_ok(request, "write")
        if reason is not None:
            raise HttpError(401, reason)
        user = self._files_user(request)
        read = fs.decoded(request.body.read, request.header("Content-Encoding"))
        ctype = request.header("Content-Type")
        media = ctype.split(";")[0].strip().lower()
        uploaded: list[UploadedEntry] = []
        metadata = fs.metadata_of(request.headers)
        if media == "application/octet-stream":
            if request.param("path") is None:
                raise HttpError(400, "path query parameter is required for raw body upload")
            path = self._files_path(request, user)
            fs.write_file(path, fs.pieces_of(read), user, metadata)
            uploaded.append(_uploaded(path))
        elif media.startswith("multipart/"):
            boundary = _boundary(ctype)
            for headers, part in fs.Multipart(read, boundary).parts():
                disposition = PartDisposition(headers)
                if disposition.param("name") != "file":
                    continue
                if request.param("path") is not None:
                    path = self._files_path(request, user)
                else:
                    filename = disposition.param("filename")
                    if not filename:
                        raise HttpError(400, "error getting multipart custom part file name: no file name")
                    try:
                        path = expand_and_resolve(filename, user, self.default_workdir)
                    except ConnectError as err:
                        raise HttpError(400, f"error resolving path: {err.message}") from None
                if any(u.path == path for u in uploaded):
                    raise HttpError(
                        400, f"you cannot upload multiple files to the same path '{path}' in one upload request"
                    )
                fs.write_file(path, fs.pieces_of(part), user, metadata)
                uploaded.append(_uploaded(path))
        else:
            raise HttpError(
                400, f"unsupported content type: {ctype}, expected multipart/form-data or application/octet-stream"
            )
        response.send_json(200, [u.to_json() for u in uploaded])


def _uploaded(path: str) -> UploadedEntry:
    return UploadedEntry(path, path.rsplit("/", 1)[-1], fs.read_metadata(path))


class PartDisposition:
    """Content-Disposition parameters of a multipart part."""

    def __init__(self, headers: Any) -> None:
        self._h = headers

    def param(self, name: str) -> str | None:
        value = self._h.get_param(name, header="content-disposition")
        if value is None:
            return None
        if isinstance(value, tuple):  # RFC 2231 encoded
            from email.utils import collapse_rfc2231_value

            return collapse_rfc2231_value(value)
        return str(value)


def _boundary(ctype: str) -> str:
    from email.message import Message

    msg = Message()
    msg["Content-Type"] = ctype
    boundary = msg.get_boundary()
    if not boundary or len(boundary) > 200:
        raise HttpError(400, "error parsing multipart form: no boundary")
    return boundary


def _accepts_gzip(header: str) -> bool:
    """envd's parseAcceptEncoding: the highest-q acceptable coding wins; `*` means gzip only if identity is refused."""
    codings: list[tuple[str, float]] = []
    for item in header.split(","):
        name, _, params = item.strip().partition(";")
        q = 1.0
        for p in params.split(";"):
            k, _, v = p.strip().partition("=")
            if k.lower() == "q":
                try:
                    q = float(v)
                except ValueError:
                    q = 1.0  # Go ignores an unparsable q
        if name.strip():
            codings.append((name.strip().lower(), q))
    identity_ok = any(n == "identity" and q > 0 for n, q in codings)
    identity_refused = any(n == "identity" and q == 0 for n, q in codings) or (
        any(n == "*" and q == 0 for n, q in codings) and not identity_ok
    )
    for name, q in sorted(codings, key=lambda nq: -nq[1]):
        if q == 0:
            continue
        if name == "identity":
            return False
        if name == "*":
            return identity_refused
        if name == "gzip":
            return True
    return False


def _as_connect_error(name: str, exc: Exception) -> ConnectError:
    if isinstance(exc, ConnectError):
        return exc
    return c.invalid(exc) if isinstance(exc, ProtoJsonError) else _internal(name, exc)


def _internal(name: str, exc: Exception) -> ConnectError:
    log(f"{name}: {type(exc).__name__}: {exc}")
    return ConnectError("internal", f"{type(exc).__name__}: {exc}"[:300])


def _timeout(request: Request) -> float | None:
    value = request.header("Connect-Timeout-Ms")
    if not value:
        return None
    try:
        ms = int(value)
    except ValueError:
        raise ConnectError("invalid_argument", f"bad Connect-Timeout-Ms {value[:20]!r}") from None
    return ms / 1000 if ms > 0 else None


def _keepalive(request: Request) -> float:
    try:
        return max(0.05, float(int(request.header("Keepalive-Ping-Interval"))))
    except ValueError:
        return DEFAULT_KEEPALIVE_S


# ---- handlers ------------------------------------------------------------------------------------------------


def _route(decode: Callable[[Json], R], handle: Callable[[Workload, R, User], Reply]) -> Unary:
    """A unary call: the request decoded into its message (a malformed field is `invalid_argument`), handled."""
    return lambda w, msg, user: handle(w, decode(msg), user)


def _list(w: Workload, req: Empty, user: User) -> ListResponse:
    return w.processes.list()


def _send_input(w: Workload, req: SendInputRequest, user: User) -> Empty:
    _input(w.processes.find(req.process), req.input or ProcessInput())
    return Empty()


def _input(proc: Process, given: ProcessInput) -> None:
    if given.pty is not None:
        proc.write_pty(given.pty)
    elif given.stdin is not None:
        proc.write_stdin(given.stdin)
    else:
        raise ConnectError("unimplemented", "invalid input type <nil>")


def _update(w: Workload, req: UpdateRequest, user: User) -> Empty:
    proc = w.processes.find(req.process)
    if req.pty is not None:
        proc.resize(req.pty.size.cols, req.pty.size.rows)
    return Empty()


def _close_stdin(w: Workload, req: ProcessRequest, user: User) -> Empty:
    w.processes.find(req.process).close_stdin()
    return Empty()


def _send_signal(w: Workload, req: SendSignalRequest, user: User) -> Empty:
    proc = w.processes.find(req.process)
    if req.signal not in (signal.SIGKILL, signal.SIGTERM):
        names = {v: k for k, v in SIGNAL_ENUM.items()}
        raise ConnectError("unimplemented", f"invalid signal: {names.get(req.signal, req.signal)}")
    proc.signal(req.signal)
    return Empty()


def _path(w: Workload, path: str, user: User) -> str:
    return expand_and_resolve(path, user, w.default_workdir)


def _create_watcher(w: Workload, req: WatchRequest, user: User) -> CreateWatcherResponse:
    path = _path(w, req.path, user)
    watch_path_checks(path, req.allow_network_mounts)
    return CreateWatcherResponse(w.watchers.create(path, req.recursive, req.include_entry))


def _watcher_events(w: Workload, req: WatcherRequest, user: User) -> GetWatcherEventsResponse:
    return GetWatcherEventsResponse(tuple(w.watchers.find(req.watcher_id).take()))


def _remove_watcher(w: Workload, req: WatcherRequest, user: User) -> Empty:
    w.watchers.remove(req.watcher_id)
    return Empty()


def _move(w: Workload, req: MoveRequest, user: User) -> Reply:
    return fs.move(_path(w, req.source, user), _path(w, req.destination, user), user)


UNARY: dict[str, Unary] = {
    "process.Process/List": _route(Empty.from_json, _list),
    "process.Process/SendInput": _route(SendInputRequest.from_json, _send_input),
    "process.Process/CloseStdin": _route(ProcessRequest.from_json, _close_stdin),
    "process.Process/Update": _route(UpdateRequest.from_json, _update),
    "process.Process/SendSignal": _route(SendSignalRequest.from_json, _send_signal),
    "filesystem.Filesystem/Stat": _route(PathRequest.from_json, lambda w, r, u: fs.stat_rpc(_path(w, r.path, u))),
    "filesystem.Filesystem/ListDir": _route(
        ListDirRequest.from_json, lambda w, r, u: fs.list_dir(_path(w, r.path, u), r.depth)
    ),
    "filesystem.Filesystem/MakeDir": _route(PathRequest.from_json, lambda w, r, u: fs.make_dir(_path(w, r.path, u), u)),
    "filesystem.Filesystem/Move": _route(MoveRequest.from_json, _move),
    "filesystem.Filesystem/Remove": _route(PathRequest.from_json, lambda w, r, u: fs.remove(_path(w, r.path, u))),
    "filesystem.Filesystem/CreateWatcher": _route(WatchRequest.from_json, _create_watcher),
    "filesystem.Filesystem/GetWatcherEvents": _route(WatcherRequest.from_json, _watcher_events),
    "filesystem.Filesystem/RemoveWatcher": _route(WatcherRequest.from_json, _remove_watcher),
}
WATCH_DIR = "filesystem.Filesystem/WatchDir"
STREAMING = ("process.Process/Start", "process.Process/Connect", WATCH_DIR)
CLIENT_STREAMING = "process.Process/StreamInput"
SERVICES = ("process.Process", "filesystem.Filesystem")
