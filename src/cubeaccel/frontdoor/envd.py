"""Sandbox traffic: the SDK's envd requests, routed to the sandbox's node and streamed both ways.

A request is envd's when it carries `E2b-Sandbox-Id` (every SDK envd request does) or its Host is
`<port>-<sandbox>.<domain>`. The front door checks `X-Access-Token` against the token it derives for that sandbox,
finds the sandbox's node through CubeMaster (cached briefly), and forwards to that node's Cubelet workload proxy,
which checks the token again (by hash) and reaches the guest. Bodies are never buffered whole, except the one
request envelope of `process.Process/Start` (≤ 1 MiB), into which the sandbox's create-time `envVars` are merged
(the command's own `envs` win). A sandbox that is gone answers 502 "… was not found", which the SDK turns into
SandboxNotRunningException.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import json
import logging
import re
import socket
import struct
import time
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, unquote

import httpx
from pydantic import ValidationError
from starlette.requests import HTTPConnection, Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from cubeaccel.frontdoor.mapping import ENVD_PORT, LIVE, Refusal, envd_token, traffic_token
from cubeaccel.frontdoor.master import FrontDoorMaster
from cubeaccel.model.ids import SANDBOX_ID_RE
from cubeaccel.model.sandbox_states import ENDED_STATES
from cubeaccel.protocol import connect_envelope
from cubeaccel.protocol.hop_by_hop import HOP_BY_HOP, SANDBOX_CHANNEL_HEADERS
from cubeaccel.transport import proxy
from cubeaccel.transport.master_client import Calls
from cubeaccel.wire.e2b_api import GuestMetrics

START_PATH = "/process.Process/Start"
MAX_START_MESSAGE = 1 << 20  # the guest's own bound for a stream request message
ROUTE_TTL_S = 5.0  # how long a sandbox → node answer is reused (a gone sandbox is re-checked at once)
NODE_TTL_S = 30.0
RUNNING_REFRESH_S = 1.0  # a signed URL that names no sandbox re-reads the running list at most this often
TRAFFIC_TOKEN_HEADER = "e2b-traffic-access-token"  # E2B's header for a sandbox's other ports
PORT_INVALID = "port.invalid"
PORT_TOKEN_REQUIRED = "port.token_required"
PORT_UPGRADE = "port.upgrade_unsupported"
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Route:
    cubelet_url: str
    env_vars: dict[str, str]


# E2B's REST paths about sandboxes; envd serves none of them (`/files`, `/health`, `/envs`, Connect services).
REST_PATHS = ("/sandboxes/", "/v2/sandboxes/")


def gone(sandbox_id: str) -> JSONResponse:
    """What E2B's own proxy answers for a sandbox that no longer exists: the SDK keys on "was not found"."""
    return JSONResponse(
        {"code": 502, "message": f"The sandbox {sandbox_id} was not found", "sandboxId": sandbox_id}, status_code=502
    )


def envd_error(status: int, message: str) -> JSONResponse:
    """A plain JSON error with an int code: the SDK maps it by status (401 → AuthenticationException)."""
    return JSONResponse({"code": status, "message": message}, status_code=status)


def host_sandbox(host: str, domain: str | None) -> tuple[int, str] | None:
    """(port, sandbox id) from `Host: 49983-<id>.<domain>`; None for any other host."""
    if not domain:
        return None
    m = re.fullmatch(r"(\d{1,5})-([A-Za-z0-9_-]{1,63})\." + re.escape(domain) + r"(?::\d+)?", host, re.IGNORECASE)
    return (int(m.group(1)), m.group(2)) if m else None


def inject_envs(payload: bytes, env_vars: dict[str, str], streaming: bool) -> bytes:
    """The Start request with the sandbox's envVars under the command's own `envs`. `streaming`: a Connect
    envelope (`[flags][len][json]`, as the SDK sends it), else a unary JSON body."""
    if not env_vars:
        return payload
    if streaming:
        one = connect_envelope.single(payload)
        if one is None or one.flags != 0:
            return payload  # malformed, compressed or not one message: leave it for the guest to judge
        message = one.payload
    else:
        message = payload
    try:
        req = json.loads(message)
    except ValueError:
        return payload
    proc = req.get("process") if isinstance(req, dict) else None
    if not isinstance(proc, dict):
        return payload
    given = proc.get("envs")
    own: dict[str, Any] = given if isinstance(given, dict) else {}
    proc["envs"] = {**env_vars, **own}
    out = json.dumps(req, separators=(",", ":")).encode()
    return connect_envelope.encode(out) if streaming else out


class EnvdProxy:
    def __init__(self, master: FrontDoorMaster, secret: bytes, domain: str | None) -> None:
        self.master = master
        self.secret = secret
        self.domain = domain
        self.http = httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=10.0), limits=httpx.Limits(max_keepalive_connections=64)
        )
        self._routes: dict[str, tuple[float, Route]] = {}
        self._nodes: dict[str, tuple[float, str]] = {}
        self._running: tuple[float, list[str]] = (float("-inf"), [])
        self._running_refresh = asyncio.Lock()  # one re-read at a time: concurrent forged URLs wait for it
        # sha256 of each running sandbox's envd token → the sandbox: a request that names its sandbox only by
        # its token is one dict lookup, not one HMAC per running sandbox. Kept per sandbox id, so a re-read
        # derives tokens only for the sandboxes it had not seen.
        self._token_digests: dict[str, bytes] = {}
        self._by_token: dict[bytes, str] = {}

    async def aclose(self) -> None:
        await self.http.aclose()

    def target(self, request: HTTPConnection) -> tuple[int, str] | None:
        """(port, sandbox id) when the request is sandbox traffic, else None (a REST call). A port header that is
        not a number is port -1, which `handle` refuses as `port.invalid`."""
        sid = request.headers.get("e2b-sandbox-id")
        if sid is not None:
            given = request.headers.get("e2b-sandbox-port") or str(ENVD_PORT)
            port = int(given) if given.isdigit() and len(given) <= 5 else -1
            if port == ENVD_PORT and "x-api-key" in request.headers and request.url.path.startswith(REST_PATHS):
                return None  # SDK 2.15's connect: a REST call (the API key, E2B's path) that names the sandbox too
            return port, sid
        return host_sandbox(request.headers.get("host", ""), self.domain)

    @staticmethod
    def unaddressed_signed_files(request: Request) -> bool:
        """A signed `/files` URL as the SDK makes it in plain-http mode (`E2B_SANDBOX_URL`): one base URL for
        every sandbox, so nothing in it names the sandbox."""
        return request.url.path == "/files" and "signature" in request.query_params

    @staticmethod
    def unaddressed_by_token(request: Request) -> bool:
        """envd traffic of a sandbox that SDK 2.15 `connect`ed in plain-http mode: that line sends the access
        token but not `E2b-Sandbox-Id` from a connected sandbox, so only the token names it (a REST call carries
        the API key instead)."""
        return "x-access-token" in request.headers and "x-api-key" not in request.headers

    async def signed_sandbox(self, request: Request) -> str | None:
        """The running sandbox whose token signed this `/files` URL (its signature is a sha256 over the
        token, so at most one matches; an expired one too, which `handle` then refuses as envd does), or
        None."""
        return await self._running_sandbox(lambda sid: signed_by(request, envd_token(self.secret, sid)))

    async def token_sandbox(self, request: Request) -> str | None:
        """The running sandbox whose envd access token the request presents, or None: found by the token's
        digest (O(1) however many sandboxes run), then checked against the sandbox's own token."""
        token = request.headers.get("x-access-token", "").encode()
        key = hashlib.sha256(token).digest()
        for attempt in range(2):
            stamp = self._running[0]
            sid = self._by_token.get(key)
            if sid is not None and hmac.compare_digest(token, envd_token(self.secret, sid).encode()):
                return sid
            if attempt or not await self._reread_running(stamp):
                return None
        return None

    async def _running_sandbox(self, match: Callable[[str], bool]) -> str | None:
        """The running sandbox `match` picks. The running list comes from CubeMaster, re-read at most once a
        `RUNNING_REFRESH_S` however many unmatched requests arrive."""
        for attempt in range(2):
            stamp, ids = self._running
            for sid in ids:
                if match(sid):
                    return sid
            if attempt or not await self._reread_running(stamp):
                return None
        return None

    async def _reread_running(self, stamp: float) -> bool:
        """Re-read CubeMaster's running list unless it was read within `RUNNING_REFRESH_S`; whether there is a
        list newer than the one read at `stamp` to try (another request may have re-read it meanwhile)."""
        async with self._running_refresh:
            if time.monotonic() - self._running[0] < RUNNING_REFRESH_S:
                return self._running[0] != stamp
            listed = await self.master.admin(Calls.sandboxes(LIVE))
            ids = [r.id for r in listed.sandboxes]
            known = self._token_digests
            digests = {sid: known.get(sid) or _token_digest(self.secret, sid) for sid in ids}
            self._token_digests, self._by_token = digests, {d: sid for sid, d in digests.items()}
            self._running = (time.monotonic(), ids)
            return True

    async def route(self, sandbox_id: str, fresh: bool = False) -> Route | None:
        """The sandbox's node and envVars (CubeMaster, with the front door's admin key); None when it is gone."""
        now = time.monotonic()
        hit = self._routes.get(sandbox_id)
        if hit is not None and hit[0] > now and not fresh:
            return hit[1]
        try:
            row = await self.master.admin(Calls.sandbox(sandbox_id))
        except Refusal as e:
            if e.status == 404:
                self._routes.pop(sandbox_id, None)
                return None
            raise
        if row.state in ENDED_STATES or not row.node:
            self._routes.pop(sandbox_id, None)
            return None
        if row.state != LIVE:
            raise Refusal(503, f"sandbox {sandbox_id} is {row.state}, not running yet", retry=True)
        node = row.node
        cached = self._nodes.get(node)
        if cached is not None and cached[0] > now and not fresh:
            url = cached[1]
        else:
            url = (await self.master.admin(Calls.node(node))).cubelet_url
            self._nodes[node] = (now + NODE_TTL_S, url)
        route = Route(url.rstrip("/"), dict(row.request.env_vars) if row.request is not None else {})
        self._routes[sandbox_id] = (now + ROUTE_TTL_S, route)
        return route

    async def guest_metrics(self, sandbox_id: str) -> GuestMetrics:
        """The guest's samples and PCI view, asked through the node's workload proxy with the sandbox's token."""
        route = await self.route(sandbox_id)
        if route is None:
            raise Refusal(404, f"sandbox {sandbox_id} not found (it is gone)")
        url = f"{route.cubelet_url}/v1/sandboxes/{quote(sandbox_id, safe='')}/workload/cubeaccel/metrics"
        try:
            r = await self.http.get(url, headers={"X-Access-Token": envd_token(self.secret, sandbox_id)}, timeout=30)
        except httpx.HTTPError as e:
            raise Refusal(502, f"sandbox {sandbox_id}: its node could not be reached: {type(e).__name__}") from e
        if r.status_code in (409, 503) and _cubelet_not_running(r.content):
            return GuestMetrics(samples=[], devices=[])  # no workload endpoint (a simulated node): nothing sampled
        if r.status_code != 200:
            raise Refusal(502, f"sandbox {sandbox_id}: its guest answered metrics with {r.status_code}")
        try:
            return GuestMetrics.model_validate_json(r.content)
        except ValidationError as e:
            raise Refusal(
                502, f"sandbox {sandbox_id}: its guest's metrics do not parse ({e.error_count()} errors)"
            ) from e

    async def handle(self, request: Request, port: int, sandbox_id: str) -> Response:
        if port != ENVD_PORT:
            return await self.handle_port(request, port, sandbox_id)
        path = request.url.path
        # Authenticated here, before anything is looked up with the front door's admin key: the sandbox's
        # token, or a signed /files URL made with it. Nothing else (not even envd's open `/health`) reaches
        # CubeMaster, so an anonymous caller learns nothing of any id and causes no admin lookup (issue 30 #7).
        expected = envd_token(self.secret, sandbox_id)
        token = request.headers.get("x-access-token")
        if token is not None:
            if not hmac.compare_digest(token.encode(), expected.encode()):
                return envd_error(401, "missing or wrong access token")
        elif path != "/files" or "signature" not in request.query_params:
            return envd_error(401, "missing or wrong access token")
        elif (refused := signature_refusal(request, expected)) is not None:
            return envd_error(401, refused)
        return await self._forward(request, sandbox_id, lambda route: self._send(request, route, sandbox_id, path))

    async def handle_port(self, request: Request, port: int, sandbox_id: str) -> Response:
        """Another port of the sandbox: the request goes through the node's workload proxy to the guest, which
        forwards it to 127.0.0.1:<port> there (workload/portforward.py). Authorised by the sandbox's traffic
        token (`e2b-traffic-access-token`) or its envd token, before anything is looked up; never public."""
        if not 1 <= port <= 65535:
            return port_error(400, PORT_INVALID, f"port {port if port >= 0 else '(not a number)'} is not 1-65535")
        if climbs(raw_target(request)):
            return port_error(400, PORT_INVALID, "a path with `.` or `..` segments (plain or percent-encoded)")
        traffic = request.headers.get(TRAFFIC_TOKEN_HEADER)
        token = request.headers.get("x-access-token")
        if traffic is not None:
            ok = hmac.compare_digest(traffic.encode(), traffic_token(self.secret, sandbox_id).encode())
        else:
            ok = token is not None and hmac.compare_digest(token.encode(), envd_token(self.secret, sandbox_id).encode())
        if not ok:
            return port_error(
                403,  # E2B's proxy answers a missing traffic token so
                PORT_TOKEN_REQUIRED,
                f"port {port} of sandbox {sandbox_id} needs the sandbox's {TRAFFIC_TOKEN_HEADER} or X-Access-Token",
            )
        if request.headers.get("upgrade"):
            return port_error(
                501,
                PORT_UPGRADE,
                f"Upgrade: {request.headers['upgrade'][:40]}: only plain HTTP/1.1 requests reach a port",
            )
        return await self._forward(request, sandbox_id, lambda route: self._send_port(request, route, sandbox_id, port))

    async def _forward(
        self, request: Request, sandbox_id: str, send: Callable[[Route], Awaitable[httpx.Response]]
    ) -> Response:
        if SANDBOX_ID_RE.fullmatch(sandbox_id) is None:
            return gone(sandbox_id)
        try:
            route = await self.route(sandbox_id)
            if route is None:
                return gone(sandbox_id)
            upstream = await send(route)
            if upstream.status_code in (409, 503):
                body = await upstream.aread()
                await upstream.aclose()
                if not _cubelet_not_running(body):  # the guest's own error (Connect uses 409 too): pass it on
                    return Response(body, status_code=upstream.status_code, headers=proxy.response_headers(upstream))
                if await self.route(sandbox_id, fresh=True) is None:
                    return gone(sandbox_id)
                return envd_error(503, f"sandbox {sandbox_id} has no workload endpoint right now")
        except Refusal as e:
            return envd_error(e.status, e.message)
        except httpx.HTTPError as e:
            again = await self.route(sandbox_id, fresh=True)
            if again is None:
                return gone(sandbox_id)
            return envd_error(502, f"sandbox {sandbox_id}: its node could not be reached: {type(e).__name__}")
        return relayed(upstream, str(request.scope.get("http_version", "1.1")))

    async def _send(self, request: Request, route: Route, sandbox_id: str, path: str) -> httpx.Response:
        body = None
        if request.method == "POST" and path == START_PATH and route.env_vars:
            raw = bytearray()
            async for chunk in request.stream():
                raw += chunk
                if len(raw) > MAX_START_MESSAGE + 5:
                    raise Refusal(413, "process start request above 1 MiB")
            streaming = "connect+" in request.headers.get("content-type", "")
            body = inject_envs(bytes(raw), route.env_vars, streaming)
        url = f"{route.cubelet_url}/v1/sandboxes/{quote(sandbox_id, safe='')}/workload{path}"
        if request.url.query:
            url += "?" + request.url.query
        return await proxy.send(self.http, request, url, proxy.request_headers(request), body=body)

    async def _send_port(self, request: Request, route: Route, sandbox_id: str, port: int) -> httpx.Response:
        """The caller's request as the app in the guest should see it: its own headers (less this hop's and the
        tokens), the caller's Host and scheme in X-Forwarded-*, and the sandbox's token for the Cubelet only."""
        headers = proxy.request_headers(request, HOP_BY_HOP | SANDBOX_CHANNEL_HEADERS)
        headers += [
            ("X-Forwarded-Host", request.headers.get("host", "")),
            ("X-Forwarded-Proto", request.url.scheme),
            ("X-Access-Token", envd_token(self.secret, sandbox_id)),
        ]
        url = f"{route.cubelet_url}/v1/sandboxes/{quote(sandbox_id, safe='')}/workload/cubeaccel/port/{port}"
        url += raw_target(request)
        if request.url.query:
            url += "?" + request.url.query
        return await proxy.send(self.http, request, url, headers, framed=True)


def raw_target(request: Request) -> str:
    return (request.scope.get("raw_path") or request.url.path.encode()).decode("latin-1")


def climbs(path: str) -> bool:
    """Whether a port request's path has a `.` or `..` segment, as sent or once percent-decoded (up to three
    times): the path is appended under the port's prefix at the Cubelet, and the HTTP clients on the way
    (httpx) remove dot segments, so `/../../process.Process/Start` would reach envd itself with the sandbox's
    token, which this hop adds: a traffic token would become a shell."""
    for _ in range(3):
        if "\\" in path or any(seg in (".", "..") for seg in path.split("/")):
            return True
        decoded = unquote(path)
        if decoded == path:
            return False
        path = decoded
    return True  # still encoded after three rounds: refused rather than guessed at


def port_error(status: int, code: str, message: str) -> JSONResponse:
    return envd_error(status, f"cubeaccel (api): {code}: {message} (docs/e2b.md)")


SIGNATURE_INVALID = "invalid signature"  # envd's words, which the SDK's tests read
SIGNATURE_EXPIRED = "signature is already expired"


def signature_refusal(request: Request, token: str) -> str | None:
    """Why a signed `/files` URL made with this sandbox's token (envd's `v1_` signature: sha256 of
    path:operation:username:token[:expiration], as the guest's workload service checks it again) is refused,
    in envd's words and order (the signature, then its expiration); None when it is good."""
    q = request.query_params
    signature, expiration = q.get("signature"), q.get("signature_expiration")
    if signature is None:
        return SIGNATURE_INVALID
    operation = "write" if request.method == "POST" else "read"
    fields = [q.get("path") or "", operation, q.get("username") or "", token]
    if expiration is not None:
        if not expiration.lstrip("-").isdigit() or len(expiration) > 20:
            return "invalid signature expiration"
        fields.append(expiration)
    digest = hashlib.sha256(":".join(fields).encode()).digest()
    expected = "v1_" + base64.b64encode(digest).decode().rstrip("=")
    if not hmac.compare_digest(expected.encode(), signature.encode("utf-8", "surrogateescape")):
        return SIGNATURE_INVALID
    if expiration is not None and int(expiration) < time.time():
        return SIGNATURE_EXPIRED
    return None


def _token_digest(secret: bytes, sandbox_id: str) -> bytes:
    return hashlib.sha256(envd_token(secret, sandbox_id).encode()).digest()


def signed_by(request: Request, token: str) -> bool:
    """Whether this sandbox's token made the URL's signature, expired or not (which sandbox a URL is for)."""
    return signature_refusal(request, token) in (None, SIGNATURE_EXPIRED)


def _cubelet_not_running(body: bytes) -> bool:
    """Whether a 409/503 body is the Cubelet saying the sandbox is not running there (not the guest's error)."""
    try:
        err = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return False
    return isinstance(err, dict) and err.get("code") in ("workload.not_running", "workload.unavailable")


# The caller's connection (an asyncio transport), for plain HTTP/1.1 (set per connection by serve.py; None
# under other servers).
CLIENT_TRANSPORT: ContextVar[Any] = ContextVar("cubeaccel_frontdoor_client_transport", default=None)


def reset_client_connection(http_version: str = "1.1") -> None:
    """Abort this HTTP/1.x connection with a TCP reset (never an h2c one: its other streams live on it). An
    upstream cut mid-stream (a sandbox killed) must reach the SDK as a dropped connection, which it answers with a
    health probe (502: "killed"); a FIN after a partial chunked body is a protocol error to it instead (pyqwest's
    RemoteProtocolError, which SDK 2.45 reads as a sandbox timeout)."""
    transport = CLIENT_TRANSPORT.get()
    if transport is None or not http_version.startswith("1"):
        return
    sock = transport.get_extra_info("socket")
    with contextlib.suppress(OSError, AttributeError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()  # closes now, without the FIN a graceful close would send first


class CutRelay(proxy.Relay):
    """The upstream's response streamed to the caller; a stream cut upstream is cut for the caller with a reset.

    A cut is designed (a sandbox killed mid-command, a command's deadline), so it is logged as one line, not as
    the server's "Error in ASGI Framework" traceback: Hypercorn ends the stream the same way whether the app
    returns or raises (`send(None)` in its `finally`), so keeping the error from it changes only the log."""

    def __init__(self, upstream: httpx.Response, http_version: str) -> None:
        self.cut_by: httpx.HTTPError | None = None
        self._http_version = http_version
        super().__init__(upstream, on_error=self._cut)

    def _cut(self, e: httpx.HTTPError) -> None:
        self.cut_by = e
        reset_client_connection(self._http_version)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except Exception:
            if self.cut_by is None:
                raise
            log.info(
                "stream cut upstream, caller's stream cut: %s %s: %s",
                scope.get("method"),
                scope.get("path"),
                type(self.cut_by).__name__,
            )


def relayed(upstream: httpx.Response, http_version: str) -> Response:
    return CutRelay(upstream, http_version)
