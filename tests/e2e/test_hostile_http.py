"""Issue 19 defects 2, 3 and 11 against real listeners: Cubelet's unix socket and TCP port, CubeMaster.

Bodies are limited by the bytes actually read (chunked ones too), headers and bodies have deadlines,
idle connections are closed, and malformed input is a 4xx in the API's JSON error format.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from cubeaccel.wire.node_sig import sign
from tests.support.cubelet_process import CubeletProcess
from tests.support.frontdoor_process import FrontDoorProcess
from tests.support.master_harness import MasterProcess, free_port
from tests.support.poll import poll

Where = tuple[str, object]  # ("unix", path) or ("tcp", (host, port))


@pytest.fixture(scope="module")
def listeners(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple[Where, object]]]:
    mp = pytest.MonkeyPatch()
    mp.setenv("CUBEACCEL_HTTP_HEADER_TIMEOUT_S", "1")
    mp.setenv("CUBEACCEL_HTTP_BODY_TIMEOUT_S", "1")
    mp.setenv("CUBEACCEL_HTTP_IDLE_TIMEOUT_S", "1")
    port = free_port()
    cub = CubeletProcess(tmp_path_factory.mktemp("cubelet"), "h100x8", "--listen", f"127.0.0.1:{port}").start()
    master = MasterProcess(tmp_path_factory.mktemp("master")).start()
    front = FrontDoorProcess(tmp_path_factory.mktemp("frontdoor"), master.url, master.admin_key).start()
    try:
        yield {
            "cubelet-unix": (("unix", str(cub.state_dir / "cubelet.sock")), cub),
            "cubelet-tcp": (("tcp", ("127.0.0.1", port)), cub),
            "master": (("tcp", ("127.0.0.1", master.port)), master),
            "frontdoor": (("tcp", ("127.0.0.1", front.port)), front),
        }
    finally:
        front.stop()
        cub.stop()
        master.stop()
        mp.undo()


LISTENERS = ["cubelet-unix", "cubelet-tcp", "master"]
CREATE = {"cubelet-unix": "/v1/reservations", "cubelet-tcp": "/v1/reservations", "master": "/v1/sandboxes"}


def _auth(proc: object, method: str, path: str, body: bytes = b"") -> str:
    """The credential headers the listener asks for: CubeMaster an admin key; the Cubelet's TCP port a request
    signed with the node token (the unix socket ignores them)."""
    key = getattr(proc, "admin_key", None)
    if key:
        return f"Authorization: Bearer {key}\r\n"
    token = getattr(proc, "token", None)
    return "".join(f"{k}: {v}\r\n" for k, v in sign(token, method, path, body).items()) if token else ""


def _connect(where: Where) -> socket.socket:
    kind, addr = where
    s = socket.socket(socket.AF_UNIX if kind == "unix" else socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(addr)  # type: ignore[arg-type]
    return s


def _read_reply(s: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """Read one HTTP reply (until the connection closes or Content-Length bytes arrived)."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = s.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed before a reply: {buf!r}")
        buf += chunk
    head, _, body = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    n = int(headers.get("content-length", "0"))
    while len(body) < n:
        chunk = s.recv(65536)
        if not chunk:
            break
        body += chunk
    return int(lines[0].split()[1]), headers, body


def _closed_within(s: socket.socket, deadline_s: float) -> bool:
    s.settimeout(deadline_s)
    try:
        while True:
            if not s.recv(65536):
                return True
    except TimeoutError:
        return False
    except (ConnectionResetError, BrokenPipeError):
        return True


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def _pid(proc: object) -> int:
    p = getattr(proc, "proc")  # noqa: B009 - both harnesses keep the Popen there
    assert p is not None
    return int(p.pid)


def _count_created(name: str, proc: object) -> int:
    if name == "master":
        return len(proc.client.sandboxes())  # type: ignore[attr-defined]
    return len(proc.client.request("GET", "/v1/reservations")["reservations"])  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", LISTENERS)
def test_a_chunked_body_over_the_limit_is_refused_by_bytes_read_and_not_acted_on(
    listeners: dict[str, tuple[Where, object]], name: str
) -> None:
    where, proc = listeners[name]
    before_count = _count_created(name, proc)
    rss_before = _rss_kib(_pid(proc))
    pad = "x" * (64 * 1024)
    body = {"sandbox_id": "chunky", "count": 1} if name != "master" else {"tenant": "t", "gpu": "H100:1"}
    first = json.dumps(body)[:-1] + ', "labels": {"pad": "'
    s = _connect(where)
    auth = _auth(proc, "POST", CREATE[name])  # the signed hash is not this body's: the size limit comes first
    s.sendall(f"POST {CREATE[name]} HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/json\r\n".encode())
    s.sendall(b"Transfer-Encoding: chunked\r\n\r\n")
    sent = 0
    try:
        for piece in [first, *[pad] * 1024]:  # up to 64 MiB; the server stops reading after 1 MiB
            data = piece.encode()
            s.sendall(b"%x\r\n%s\r\n" % (len(data), data))
            sent += len(data)
    except (BrokenPipeError, ConnectionResetError):
        pass
    status, headers, reply = _read_reply(s)
    s.close()
    assert status == 413, reply
    assert json.loads(reply)["error"]["code"] == "api.body_too_large"
    assert headers.get("connection") == "close"
    assert sent < 48 * 1024 * 1024, "the server kept reading an oversized body"
    assert _rss_kib(_pid(proc)) - rss_before < 32 * 1024
    assert _count_created(name, proc) == before_count


@pytest.mark.parametrize("name", [*LISTENERS, "frontdoor"])
def test_half_sent_headers_and_idle_connections_are_closed(
    listeners: dict[str, tuple[Where, object]], name: str
) -> None:
    where, _ = listeners[name]
    idle = [_connect(where) for _ in range(20)]
    half = [_connect(where) for _ in range(20)]
    for s in half:
        s.sendall(b"POST /v1/reservations HTTP/1.1\r\nHost: x\r\nContent-Le")
    assert all(_closed_within(s, 8.0) for s in idle + half)
    for s in idle + half:
        s.close()


@pytest.mark.parametrize("name", LISTENERS)
def test_a_slow_body_is_dropped_with_408(listeners: dict[str, tuple[Where, object]], name: str) -> None:
    where, proc = listeners[name]
    s = _connect(where)
    auth = _auth(proc, "POST", CREATE[name], b"x" * 100)
    s.sendall(f'POST {CREATE[name]} HTTP/1.1\r\nHost: x\r\n{auth}Content-Length: 100\r\n\r\n{{"sand'.encode())
    t0 = time.monotonic()
    status, _, reply = _read_reply(s)
    assert status == 408 and json.loads(reply)["error"]["code"] == "api.body_timeout"
    assert time.monotonic() - t0 < 8.0
    assert _closed_within(s, 5.0)
    s.close()


@pytest.mark.parametrize("name", LISTENERS)
def test_a_kept_alive_connection_still_serves_requests(listeners: dict[str, tuple[Where, object]], name: str) -> None:
    where, _ = listeners[name]
    s = _connect(where)
    for _ in range(3):
        s.sendall(b"GET /v1/health HTTP/1.1\r\nHost: x\r\n\r\n")
        status, _, _ = _read_reply(s)
        assert status == 200
    s.close()


@pytest.mark.parametrize("name", LISTENERS)
@pytest.mark.parametrize(
    ("body", "code"),
    [
        (b'{"sandbox_id": "\xff\xfe", "count": 1}', "api.malformed_json"),
        (b"[" * 100000 + b"]" * 100000, "api.too_deep"),
        (b'{"a": ' * 40 + b"1" + b"}" * 40, "api.too_deep"),
        (b'\xef\xbb\xbf{"sandbox_id": "bom", "count": 1}', "api.byte_order_mark"),
        (b'{"sandbox_id": "dup", "count": 1, "count": 1}', "api.duplicate_key"),
        (b'{"sandbox_id": "nan", "count": NaN}', "api.non_finite_number"),
        (b'{"sandbox_id": "inf", "count": 1e400}', "api.non_finite_number"),
    ],
)
def test_malformed_bodies_are_422_in_the_error_format_and_create_nothing(
    listeners: dict[str, tuple[Where, object]], name: str, body: bytes, code: str
) -> None:
    where, proc = listeners[name]
    if name == "master":
        body = body.replace(b'"sandbox_id"', b'"tenant": "t", "gpu": "H100:1", "id"').replace(b'"count"', b'"vcpus"')
    before = _count_created(name, proc)
    s = _connect(where)
    s.sendall(
        f"POST {CREATE[name]} HTTP/1.1\r\nHost: x\r\n{_auth(proc, 'POST', CREATE[name], body)}"
        "Content-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    status, _, reply = _read_reply(s)
    s.close()
    assert status == 422, reply
    assert json.loads(reply)["error"]["code"] == code
    assert set(json.loads(reply)["error"]) == {"code", "layer", "message", "details"}
    assert _count_created(name, proc) == before


@pytest.mark.parametrize("name", LISTENERS)
def test_an_unparseable_request_gets_a_json_error(listeners: dict[str, tuple[Where, object]], name: str) -> None:
    where, _ = listeners[name]
    s = _connect(where)
    s.sendall(b"GET /v1/health HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n")
    status, headers, reply = _read_reply(s)
    s.close()
    assert status == 400 and headers["content-type"] == "application/json"
    assert json.loads(reply)["error"]["code"] == "api.bad_http_request"


@pytest.mark.parametrize("name", [*LISTENERS, "frontdoor"])
def test_headers_over_16_kib_are_refused_with_431(listeners: dict[str, tuple[Where, object]], name: str) -> None:
    """docs/api.md's bound, also when the whole request arrives in one read (h11 only bounds what it buffers)."""
    where, _ = listeners[name]
    path = "/health" if name == "frontdoor" else "/v1/health"
    s = _connect(where)
    s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nX-Pad: {'p' * 100_000}\r\n\r\n".encode())
    status, _, _ = _read_reply(s)
    assert status == 431
    assert _closed_within(s, 5.0)
    s.close()
    s = _connect(where)  # just under the bound still passes
    s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nX-Pad: {'p' * 15_000}\r\n\r\n".encode())
    assert _read_reply(s)[0] == 200
    s.close()


def test_the_front_door_drops_a_slow_body_like_the_other_servers(listeners: dict[str, tuple[Where, object]]) -> None:
    where, _ = listeners["frontdoor"]
    s = _connect(where)
    s.sendall(b'POST /sandboxes HTTP/1.1\r\nHost: x\r\nX-API-Key: k\r\nContent-Length: 100\r\n\r\n{"temp')
    t0 = time.monotonic()
    status, _, _ = _read_reply(s)
    assert status == 408 and time.monotonic() - t0 < 8.0
    assert _closed_within(s, 5.0)
    s.close()


def test_anonymous_envd_health_makes_no_admin_lookup_and_says_nothing_of_the_id(
    listeners: dict[str, tuple[Where, object]],
) -> None:
    """Without the sandbox's access token nothing is looked up with the front door's admin key, and every id —
    taken or free, well-formed or not — gets the same answer."""
    where, _ = listeners["frontdoor"]
    master = listeners["master"][1]
    audit: Path = master.audit_log  # type: ignore[attr-defined]
    before = audit.read_text().count("\n")
    answers = set()
    for sid in ("sb-0123456789abcdef", "t0123456789ab-anything", "no/such id"):
        s = _connect(where)
        s.sendall(f"GET /health HTTP/1.1\r\nHost: x\r\nE2b-Sandbox-Id: {sid}\r\n\r\n".encode())
        status, _, body = _read_reply(s)
        s.close()
        answers.add((status, body.replace(sid.encode(), b"ID")))
    assert len(answers) == 1 and next(iter(answers))[0] == 401, answers
    assert audit.read_text().count("\n") == before, "the front door looked the id up as the admin"


def test_listeners_still_answer_after_the_attacks(listeners: dict[str, tuple[Where, object]]) -> None:
    for name, (_, proc) in listeners.items():
        if name == "frontdoor":
            assert poll(lambda p=proc: httpx.get(f"{p.url}/health").status_code == 200)  # type: ignore[attr-defined]
        else:
            assert poll(lambda p=proc: p.client.health())  # type: ignore[attr-defined]
