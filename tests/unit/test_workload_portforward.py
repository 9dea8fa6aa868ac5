"""Other ports of a sandbox over the workload channel (workload/portforward.py): the real guest service (a
subprocess) forwards to a real TCP app on 127.0.0.1, and the bytes that cross — request bodies and replies in
every HTTP/1.1 framing, cut anywhere — arrive whole and in order (Hypothesis); refusals are catalogued; a reply
streams as the app writes it. Then the same through the real Cubelet's workload proxy and the shim's bridge, and
the front door's checks that come before any lookup."""

from __future__ import annotations

import asyncio
import itertools
import json
import queue
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient, WebSocketDenialResponse

from cubeaccel.frontdoor import mapping as M
from cubeaccel.frontdoor.app import FrontDoorConfig, create_app
from cubeaccel.workload.http1 import read_request, socket_connection
from cubeaccel.workload.portforward import PORT_PREFIX, PortError, request_head, split_target
from tests.unit.test_workload_proxy import proxied
from tests.workload_client import ServerProcess, WorkloadClient, workload_server

__all__ = ["proxied"]


@dataclass
class Seen:
    method: str
    target: str
    headers: dict[str, str]
    body: bytes


@dataclass
class App:
    """A TCP app on 127.0.0.1: records each request (parsed by the guest's own HTTP/1.1 reader) and answers with
    the next scripted reply, sent in the given pieces (each a separate write), then closes."""

    sock: socket.socket
    replies: queue.Queue[list[bytes]] = field(default_factory=queue.Queue)
    seen: queue.Queue[Seen] = field(default_factory=queue.Queue)
    gate: threading.Event | None = None  # when set: the app waits for it after its first piece

    @property
    def port(self) -> int:
        return int(self.sock.getsockname()[1])

    def reset(self) -> None:
        for q in (self.replies, self.seen):
            while not q.empty():
                q.get_nowait()

    def serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        c = socket_connection(conn, "app")
        try:
            req = read_request(c)
            assert req is not None
            body = req.body.read_all(1 << 24)
            headers = {str(k).lower(): str(v) for k, v in req.headers.items()}
            self.seen.put(Seen(req.method, req.target, headers, body))
            pieces = self.replies.get(timeout=30)
            for i, piece in enumerate(pieces):
                conn.sendall(piece)
                if i == 0 and self.gate is not None:
                    self.gate.wait(30)
        finally:
            c.close()


@pytest.fixture(scope="module")
def app() -> Iterator[App]:
    sock = socket.create_server(("127.0.0.1", 0))
    a = App(sock)
    threading.Thread(target=a.serve, daemon=True).start()
    yield a
    sock.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with workload_server(tmp_path_factory.mktemp("portforward")) as srv:
        yield srv


@pytest.fixture(scope="module")
def wl(server: ServerProcess) -> Iterator[WorkloadClient]:
    client = server.client(timeout=20)
    yield client
    client.http.close()


def reply_bytes(status: int, body: bytes, framing: str, chunk_sizes: list[int]) -> bytes:
    head = f"HTTP/1.1 {status} Whatever\r\nX-App: yes\r\nConnection: close, X-Private\r\nX-Private: no\r\n"
    if framing == "length":
        return (head + f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    if framing == "close":
        return (head + "\r\n").encode() + body
    out, rest = bytearray((head + "Transfer-Encoding: chunked\r\n\r\n").encode()), body
    for size in [*chunk_sizes, len(body)]:
        piece, rest = rest[: max(size, 1)], rest[max(size, 1) :]
        if piece:
            out += b"%x;ext=1\r\n%b\r\n" % (len(piece), piece)
    return bytes(out + b"0\r\nX-Trailer: t\r\n\r\n")


def cut(data: bytes, at: list[int]) -> list[bytes]:
    points = sorted({p % (len(data) + 1) for p in at} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(points) if b > a] or [b""]


def error_code(r: httpx.Response) -> str:
    body = json.loads(r.content)
    assert body["code"] == r.status_code
    return str(body["message"]).split(": ")[1]


# ---- the target and the head ----------------------------------------------------------------------------------


@given(port=st.integers(0, 99999), path=st.text("abz/%._-~+=&", max_size=30), query=st.text("a=&b%", max_size=10))
def test_a_port_target_splits_into_port_and_the_apps_own_target(port: int, path: str, query: str) -> None:
    target = f"{PORT_PREFIX}{port}" + (f"/{path}" if path else "") + (f"?{query}" if query else "")
    if not 1 <= port <= 65535:
        with pytest.raises(PortError) as err:
            split_target(target)
        assert (err.value.status, err.value.code) == (400, "port.invalid")
        return
    assert split_target(target) == (port, "/" + path + (f"?{query}" if query else ""))


@pytest.mark.parametrize("target", ["/cubeaccel/port/", "/cubeaccel/port/80x/", "/cubeaccel/port/123456/", "/x"])
def test_a_malformed_port_target_is_port_invalid(target: str) -> None:
    with pytest.raises(PortError) as err:
        split_target(target)
    assert err.value.code == "port.invalid"


@given(
    headers=st.lists(
        st.tuples(st.text("abcXY-", min_size=1, max_size=8), st.text("abc 123;=", max_size=12)), max_size=6
    ),
    framing=st.sampled_from([None, "chunked", "0", "17"]),
)
def test_the_forwarded_head_parses_back_with_its_framing(headers: list[tuple[str, str]], framing: str | None) -> None:
    import http.client
    import io

    head = request_head("POST", "/a?b=c", 8000, headers, framing)
    fp = io.BytesIO(head)
    assert fp.readline() == b"POST /a?b=c HTTP/1.1\r\n"
    parsed = http.client.parse_headers(fp)
    assert parsed["Host"] == "localhost:8000" and parsed["Connection"] == "close"
    assert parsed.get("Transfer-Encoding") == ("chunked" if framing == "chunked" else None)
    assert parsed.get("Content-Length") == (framing if framing not in (None, "chunked") else None)
    assert fp.read() == b""


# ---- through the guest service --------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    body=st.binary(max_size=3000),
    req_framing=st.sampled_from(["length", "chunked"]),
    req_pieces=st.lists(st.integers(0, 3000), max_size=4),
    status=st.sampled_from([200, 201, 404, 418, 500]),
    reply=st.binary(max_size=6000),
    reply_framing=st.sampled_from(["length", "chunked", "close"]),
    chunk_sizes=st.lists(st.integers(1, 700), max_size=5),
    wire_cuts=st.lists(st.integers(0, 10000), max_size=6),
)
def test_bodies_and_replies_cross_whole_in_every_framing_however_they_are_cut(
    wl: WorkloadClient,
    app: App,
    body: bytes,
    req_framing: str,
    req_pieces: list[int],
    status: int,
    reply: bytes,
    reply_framing: str,
    chunk_sizes: list[int],
    wire_cuts: list[int],
) -> None:
    app.reset()  # what a failed example left behind must not be the next one's
    app.replies.put(cut(reply_bytes(status, reply, reply_framing, chunk_sizes), wire_cuts))
    pieces = cut(body, req_pieces)
    content: Any = body if req_framing == "length" else iter(pieces)
    r = wl.http.post(
        f"{PORT_PREFIX}{app.port}/up/load?x=1&y=%2F",
        content=content,
        headers={**wl.headers(), "X-Mine": "kept", "Content-Type": "application/octet-stream"},
    )
    seen = app.seen.get(timeout=10)
    assert (seen.method, seen.target, seen.body) == ("POST", "/up/load?x=1&y=%2F", body)
    assert seen.headers["x-mine"] == "kept" and seen.headers["host"] == f"localhost:{app.port}"
    assert "x-access-token" not in seen.headers  # the sandbox's token never reaches the app
    if req_framing == "length":
        assert seen.headers["content-length"] == str(len(body)) and "transfer-encoding" not in seen.headers
    else:
        assert seen.headers["transfer-encoding"] == "chunked"
    assert (r.status_code, r.content, r.headers["x-app"]) == (status, reply, "yes")
    assert "x-private" not in r.headers  # named by the app's Connection header: this hop's only


def test_a_reply_streams_as_the_app_writes_it(wl: WorkloadClient, app: App) -> None:
    app.gate = threading.Event()
    try:
        app.replies.put(
            [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n", b"4\r\nlast\r\n0\r\n\r\n"]
        )
        with wl.http.stream("GET", f"{PORT_PREFIX}{app.port}/", headers=wl.headers()) as r:
            pieces = r.iter_raw()
            assert next(pieces) == b"first"  # before the app has written the rest
            app.gate.set()
            assert b"".join(pieces) == b"last"
        app.seen.get(timeout=10)
    finally:
        app.gate.set()
        app.gate = None


def test_head_keeps_the_apps_length_and_a_204_has_no_body(wl: WorkloadClient, app: App) -> None:
    app.replies.put([b"HTTP/1.1 200 OK\r\nContent-Length: 12345\r\n\r\n"])
    r = wl.http.head(f"{PORT_PREFIX}{app.port}/big", headers=wl.headers())
    assert (r.status_code, r.headers["content-length"], r.content) == (200, "12345", b"")
    assert app.seen.get(timeout=10).method == "HEAD"
    app.replies.put([b"HTTP/1.1 204 No Content\r\n\r\n"])
    r = wl.http.delete(f"{PORT_PREFIX}{app.port}/thing", headers=wl.headers())
    assert (r.status_code, r.content) == (204, b"")
    assert app.seen.get(timeout=10).method == "DELETE"


def test_a_reply_cut_short_fails_the_request_and_the_service_keeps_serving(wl: WorkloadClient, app: App) -> None:
    app.replies.put([b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly ten b"])
    with pytest.raises(httpx.RemoteProtocolError):
        wl.http.get(f"{PORT_PREFIX}{app.port}/", headers=wl.headers())
    app.seen.get(timeout=10)
    app.replies.put([b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"])
    assert wl.http.get(f"{PORT_PREFIX}{app.port}/", headers=wl.headers()).content == b"ok"
    app.seen.get(timeout=10)


def test_refusals_are_catalogued(wl: WorkloadClient, app: App) -> None:
    closed = socket.create_server(("127.0.0.1", 0))
    free = closed.getsockname()[1]
    closed.close()
    r = wl.http.get(f"{PORT_PREFIX}{free}/", headers=wl.headers())
    assert r.status_code == 502 and error_code(r) == "port.not_listening" and str(free) in r.text
    r = wl.http.get(f"{PORT_PREFIX}70000/", headers=wl.headers())
    assert r.status_code == 400 and error_code(r) == "port.invalid"
    r = wl.http.get(f"{PORT_PREFIX}{app.port}/", headers={**wl.headers(), "Upgrade": "websocket"})
    assert r.status_code == 501 and error_code(r) == "port.upgrade_unsupported"
    app.replies.put([b"SSH-2.0-not-http\r\n"])
    r = wl.http.get(f"{PORT_PREFIX}{app.port}/", headers=wl.headers())
    assert r.status_code == 502 and error_code(r) == "port.bad_reply"
    app.seen.get(timeout=10)
    for token in ("", "wrong"):
        r = wl.http.get(f"{PORT_PREFIX}{app.port}/", headers={"X-Access-Token": token} if token else {})
        assert r.status_code == 401
    assert app.seen.empty()  # nothing refused reached the app


# ---- through the Cubelet's workload proxy and the shim's bridge ------------------------------------------------


def test_the_cubelet_proxy_carries_any_method_raw_paths_and_fixed_length_bodies(
    proxied: tuple[Any, WorkloadClient], app: App
) -> None:
    _, wl = proxied
    app.replies.put([b"HTTP/1.1 201 Created\r\nContent-Length: 4\r\n\r\ndone"])
    r = wl.http.put(f"/cubeaccel/port/{app.port}/a%2Fb/c?q=%20x&q=2", content=b"payload", headers=wl.headers())
    assert (r.status_code, r.content) == (201, b"done")
    seen = app.seen.get(timeout=10)
    assert (seen.method, seen.target, seen.body) == ("PUT", "/a%2Fb/c?q=%20x&q=2", b"payload")
    assert seen.headers["content-length"] == "7"  # an app that cannot read chunked bodies still can
    r = wl.http.get(f"/cubeaccel/port/{app.port}/", headers={"X-Access-Token": "wrong"})
    assert r.status_code == 401 and app.seen.empty()


# ---- the front door's checks, before any lookup ---------------------------------------------------------------


@pytest.fixture
def front() -> Iterator[TestClient]:
    cfg = FrontDoorConfig("http://127.0.0.1:9", "admin", b"s" * 32, domain="e2b.test")  # no CubeMaster there
    with TestClient(create_app(cfg), base_url="http://api.e2b.test") as tc:
        yield tc


def test_the_front_door_refuses_bad_ports_missing_tokens_and_websockets_before_any_lookup(front: TestClient) -> None:
    sid = "sb-0123456789"
    traffic = {"e2b-traffic-access-token": M.traffic_token(b"s" * 32, sid)}
    for port in ("70000", "0", "80a", "-1"):
        r = front.get("/", headers={"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": port, **traffic})
        assert r.status_code == 400 and error_code(r) == "port.invalid", port
    r = front.get("/", headers={"Host": f"99999-{sid}.e2b.test", **traffic})
    assert r.status_code == 400 and error_code(r) == "port.invalid"
    for headers in ({}, {"e2b-traffic-access-token": "x"}, {"X-Access-Token": M.traffic_token(b"s" * 32, sid)}):
        r = front.get("/", headers={"Host": f"8000-{sid}.e2b.test", **headers})
        assert r.status_code == 403 and error_code(r) == "port.token_required"
    r = front.get("/", headers={"Host": f"8000-{sid}.e2b.test", "Upgrade": "h2c-like", **traffic})
    assert r.status_code == 501 and error_code(r) == "port.upgrade_unsupported"
    ws_headers = {"Host": f"8000-{sid}.e2b.test", **traffic}
    with pytest.raises(WebSocketDenialResponse) as denied, front.websocket_connect("/", headers=ws_headers):
        pass
    assert denied.value.status_code == 501 and "port.upgrade_unsupported" in denied.value.text
    # the envd token and the traffic token pass the check, and only then is CubeMaster asked (unreachable: 502)
    r = front.get("/", headers={"Host": f"8000-{sid}.e2b.test", **traffic})
    assert r.status_code in (502, 503) and "port." not in r.text
    r = front.get("/", headers={"Host": f"8000-{sid}.e2b.test", "X-Access-Token": M.envd_token(b"s" * 32, sid)})
    assert r.status_code in (502, 503) and "port." not in r.text


def test_the_traffic_token_differs_from_the_envd_token_and_from_other_sandboxes() -> None:
    secret = b"k" * 32
    assert M.traffic_token(secret, "a") != M.envd_token(secret, "a")
    assert M.traffic_token(secret, "a") != M.traffic_token(secret, "b")
    assert M.traffic_token(secret, "a") == M.traffic_token(secret, "a")


def _raw_get(raw_path: bytes, headers: dict[str, str]) -> tuple[int, str]:
    """A GET with its path exactly as sent (an HTTP client would remove the dot segments first; curl
    --path-as-is and any hand-written client do not)."""
    app = create_app(FrontDoorConfig("http://127.0.0.1:9", "admin", b"s" * 32, domain="e2b.test"))
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": unquote(raw_path.decode()),
        "raw_path": raw_path,
        "query_string": b"",
        "root_path": "",
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
        "client": ("127.0.0.1", 40000),
        "server": ("api.e2b.test", 80),
    }
    asyncio.run(app(scope, receive, send))  # type: ignore[arg-type]
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return int(sent[0]["status"]), body.decode()


@pytest.mark.parametrize(
    "raw_path",
    [
        b"/../../../process.Process/Start",
        b"/a/./b",
        b"/%2e%2e/%2E%2E/process.Process/Start",
        b"/x%2f..%2f..%2fprocess.Process/Start",
        b"/%252e%252e/process.Process/Start",
        b"/..%5c..%5cprocess.Process/Start",
    ],
)
def test_a_port_path_that_could_climb_to_envd_is_refused_before_any_lookup(raw_path: bytes) -> None:
    """The path is appended under the port's prefix at the Cubelet with the sandbox's envd token, and httpx
    removes dot segments on the way: `/../../process.Process/Start` would have been a shell for anyone holding
    only the shareable traffic token."""
    sid = "sb-0123456789"
    headers = {"Host": f"8000-{sid}.e2b.test", "e2b-traffic-access-token": M.traffic_token(b"s" * 32, sid)}
    status, body = _raw_get(raw_path, headers)
    assert status == 400 and "port.invalid" in body, (status, body)
    status, body = _raw_get(b"/plain/path.txt", headers)
    assert status in (502, 503) and "port." not in body  # an ordinary path passes on to CubeMaster (unreachable)
