"""Hostile HTTP against every real listener: Cubelet's unix socket and TCP port, CubeMaster, the E2B front door.

One server edge for all (issue 31): bodies are limited by the bytes actually read (chunked ones too) and parsed as
strict JSON, headers and bodies have deadlines, idle connections are closed, and malformed input is a 4xx with a
catalogued code in the listener's error format (CubeMaster's and the Cubelet's `{"error": {...}}`, E2B's
`{"code", "message"}` at the front door, the code leading the message). After every attack the listener still
serves the next good request.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import resource
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cubeaccel.protocol.error_catalog import CATALOG
from cubeaccel.transport.node_sig import sign
from tests.support.cubelet_process import CubeletProcess
from tests.support.frontdoor_process import FrontDoorProcess
from tests.support.master_harness import MasterProcess, free_port
from tests.support.poll import poll

Where = tuple[str, object]  # ("unix", path) or ("tcp", (host, port))
LISTENERS = ["cubelet-unix", "cubelet-tcp", "master", "frontdoor"]
E2B_MESSAGE = re.compile(r"^cubeaccel \((\w+)\): ([a-z_]+\.[a-z_]+): ")


@dataclass(frozen=True)
class Listener:
    name: str
    where: Where
    proc: object
    create: str  # a route that reads a JSON body
    fields: bytes  # that body's required fields, as JSON members
    health: str
    e2b: bool  # answers in E2B's error format
    auth: Callable[[str, str, bytes], str]  # (method, path, body) -> credential header lines
    created: Callable[[], int]  # how many things the create route has made so far

    def with_fields(self, body: bytes) -> bytes:
        return body.replace(b"@", self.fields)


def _signed(token: str) -> Callable[[str, str, bytes], str]:
    return lambda method, path, body: "".join(f"{k}: {v}\r\n" for k, v in sign(token, method, path, body).items())


@pytest.fixture(scope="module")
def listeners(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Listener]]:
    mp = pytest.MonkeyPatch()
    mp.setenv("CUBEACCEL_HTTP_HEADER_TIMEOUT_S", "1")
    mp.setenv("CUBEACCEL_HTTP_BODY_TIMEOUT_S", "1")
    mp.setenv("CUBEACCEL_HTTP_IDLE_TIMEOUT_S", "1")
    port = free_port()
    cub = CubeletProcess(tmp_path_factory.mktemp("cubelet"), "h100x8", "--listen", f"127.0.0.1:{port}").start()
    master = MasterProcess(tmp_path_factory.mktemp("master")).start()
    front = FrontDoorProcess(tmp_path_factory.mktemp("frontdoor"), master.url, master.admin_key).start()

    def reservations() -> int:
        return len(cub.client.request("GET", "/v1/reservations")["reservations"])

    def sandboxes() -> int:
        return len(master.client.sandboxes())

    reserve = b'"sandbox_id": "hostile", "count": 1'
    try:
        yield {
            "cubelet-unix": Listener(
                "cubelet-unix",
                ("unix", str(cub.state_dir / "cubelet.sock")),
                cub,
                "/v1/reservations",
                reserve,
                "/v1/health",
                False,
                lambda *_: "",
                reservations,
            ),
            "cubelet-tcp": Listener(
                "cubelet-tcp",
                ("tcp", ("127.0.0.1", port)),
                cub,
                "/v1/reservations",
                reserve,
                "/v1/health",
                False,
                _signed(str(cub.token)),
                reservations,
            ),
            "master": Listener(
                "master",
                ("tcp", ("127.0.0.1", master.port)),
                master,
                "/v1/sandboxes",
                b'"tenant": "t", "gpu": "H100:1"',
                "/v1/health",
                False,
                lambda *_: f"Authorization: Bearer {master.admin_key}\r\n",
                sandboxes,
            ),
            "frontdoor": Listener(
                "frontdoor",
                ("tcp", ("127.0.0.1", front.port)),
                front,
                "/sandboxes",
                b'"templateID": "edu-demo"',
                "/health",
                True,
                lambda *_: f"X-API-Key: {master.tenant_key}\r\n",
                sandboxes,
            ),
        }
    finally:
        front.stop()
        cub.stop()
        master.stop()
        mp.undo()


def _connect(where: Where) -> socket.socket:
    kind, addr = where
    s = socket.socket(socket.AF_UNIX if kind == "unix" else socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(addr)  # type: ignore[arg-type]
    return s


def _read_reply(s: socket.socket, buf: bytearray | None = None) -> tuple[int, dict[str, str], bytes]:
    """Read one HTTP reply (until the connection closes or Content-Length bytes arrived). `buf`: bytes already
    read past the previous reply on this connection (pipelined replies), kept up to date."""
    buf = bytearray() if buf is None else buf
    while b"\r\n\r\n" not in buf:
        chunk = s.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed before a reply: {bytes(buf)!r}")
        buf += chunk
    head, _, rest = bytes(buf).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    n = int(headers.get("content-length", "0"))
    while len(rest) < n:
        chunk = s.recv(65536)
        if not chunk:
            break
        rest += chunk
    buf[:] = rest[n:]
    return int(lines[0].split()[1]), headers, rest[:n]


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
    p = getattr(proc, "proc")  # noqa: B009 - the harnesses keep the Popen there
    assert p is not None
    return int(p.pid)


def _refused_with(lis: Listener, status: int, reply: bytes) -> str:
    """The catalogued code of an error reply, checked against its status and the listener's error format."""
    body = json.loads(reply)
    if lis.e2b:
        assert set(body) == {"code", "message"} and body["code"] == status, body
        match = E2B_MESSAGE.match(body["message"])
        assert match, body
        code = match.group(2)
        want = CATALOG[code].status
        assert status == (400 if want == 422 else want), (status, code)  # E2B says 400 for a request it cannot take
    else:
        assert set(body["error"]) == {"code", "layer", "message", "details"}, body
        code = body["error"]["code"]
        assert status == CATALOG[code].status, (status, code)
    return str(code)


def _serves_the_next_request(lis: Listener) -> None:
    assert _health_status(lis) == 200


def _health_status(lis: Listener) -> int:
    """The status of a health request on a new connection (errors propagate: poll counts them as not yet)."""
    s = _connect(lis.where)
    try:
        s.sendall(f"GET {lis.health} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        return _read_reply(s)[0]
    finally:
        s.close()


def _post(lis: Listener, body: bytes, extra: str = "") -> tuple[int, dict[str, str], bytes]:
    s = _connect(lis.where)
    s.sendall(
        f"POST {lis.create} HTTP/1.1\r\nHost: x\r\n{lis.auth('POST', lis.create, body)}{extra}"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    try:
        return _read_reply(s)
    finally:
        s.close()


@pytest.mark.parametrize("name", LISTENERS)
def test_a_chunked_body_over_the_limit_is_refused_by_bytes_read_and_not_acted_on(
    listeners: dict[str, Listener], name: str
) -> None:
    lis = listeners[name]
    before_count = lis.created()
    rss_before = _rss_kib(_pid(lis.proc))
    pad = "x" * (64 * 1024)
    first = lis.with_fields(b'{@, "labels": {"pad": "').decode()
    s = _connect(lis.where)
    auth = lis.auth("POST", lis.create, b"")  # the signed hash is not this body's: the size limit comes first
    s.sendall(f"POST {lis.create} HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/json\r\n".encode())
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
    assert _refused_with(lis, status, reply) == "api.body_too_large"
    assert headers.get("connection") == "close"
    assert sent < 48 * 1024 * 1024, "the server kept reading an oversized body"
    assert _rss_kib(_pid(lis.proc)) - rss_before < 32 * 1024
    assert lis.created() == before_count
    _serves_the_next_request(lis)


@pytest.mark.parametrize("name", LISTENERS)
def test_a_declared_body_over_the_limit_is_refused_before_it_is_read(listeners: dict[str, Listener], name: str) -> None:
    lis = listeners[name]
    s = _connect(lis.where)
    s.sendall(
        f"POST {lis.create} HTTP/1.1\r\nHost: x\r\n{lis.auth('POST', lis.create, b'')}"
        f"Content-Length: {64 << 20}\r\n\r\n{{".encode()
    )
    status, headers, reply = _read_reply(s)
    assert status == 413 and _refused_with(lis, status, reply) == "api.body_too_large"
    assert headers.get("connection") == "close" and _closed_within(s, 5.0)
    s.close()
    _serves_the_next_request(lis)


@pytest.mark.parametrize("name", LISTENERS)
def test_half_sent_headers_and_idle_connections_are_closed(listeners: dict[str, Listener], name: str) -> None:
    lis = listeners[name]
    idle = [_connect(lis.where) for _ in range(20)]
    half = [_connect(lis.where) for _ in range(20)]
    for s in half:
        s.sendall(f"POST {lis.create} HTTP/1.1\r\nHost: x\r\nContent-Le".encode())
    assert all(_closed_within(s, 8.0) for s in idle + half)
    for s in idle + half:
        s.close()
    _serves_the_next_request(lis)


@pytest.mark.parametrize("name", LISTENERS)
def test_headers_dripped_a_byte_at_a_time_are_cut_at_the_header_deadline(
    listeners: dict[str, Listener], name: str
) -> None:
    """Slowloris: each byte arrives well within any per-read timeout, so only a deadline on the whole header
    (1 s here) ends it; the connection is closed while the client is still sending."""
    lis = listeners[name]
    s = _connect(lis.where)
    s.sendall(f"GET {lis.health} HTTP/1.1\r\nHost: x\r\n".encode())
    s.settimeout(0.2)  # the pace of the drip: a byte whenever 0.2 s pass with nothing from the server
    t0 = time.monotonic()
    closed = False
    while not closed and time.monotonic() - t0 < 8.0:
        try:
            closed = not s.recv(65536)
        except TimeoutError:
            try:
                s.sendall(b"X")
            except (BrokenPipeError, ConnectionResetError):
                closed = True
        except ConnectionResetError:
            closed = True
    s.close()
    assert closed, "a connection dripping its headers was still open after 8 s"
    _serves_the_next_request(lis)


@pytest.mark.parametrize("name", LISTENERS)
def test_a_slow_body_is_dropped_with_408(listeners: dict[str, Listener], name: str) -> None:
    lis = listeners[name]
    s = _connect(lis.where)
    auth = lis.auth("POST", lis.create, b"x" * 100)
    s.sendall(f'POST {lis.create} HTTP/1.1\r\nHost: x\r\n{auth}Content-Length: 100\r\n\r\n{{"sand'.encode())
    t0 = time.monotonic()
    status, _, reply = _read_reply(s)
    assert status == 408 and _refused_with(lis, status, reply) == "api.body_timeout"
    assert time.monotonic() - t0 < 8.0
    assert _closed_within(s, 5.0)
    s.close()
    _serves_the_next_request(lis)


@pytest.mark.parametrize("name", LISTENERS)
def test_a_kept_alive_connection_still_serves_requests(listeners: dict[str, Listener], name: str) -> None:
    lis = listeners[name]
    s = _connect(lis.where)
    for _ in range(3):
        s.sendall(f"GET {lis.health} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        status, _, _ = _read_reply(s)
        assert status == 200
    s.close()


MALFORMED = [
    (b'{@, "label": "\xff\xfe"}', "api.malformed_json"),
    (b"[" * 100000 + b"]" * 100000, "api.too_deep"),
    (b'{"a": ' * 40 + b"1" + b"}" * 40, "api.too_deep"),
    (b"\xef\xbb\xbf{@}", "api.byte_order_mark"),
    (b'{@, "dup": 1, "dup": 1}', "api.duplicate_key"),
    (b'{@, "n": NaN}', "api.non_finite_number"),
    (b'{@, "n": 1e400}', "api.non_finite_number"),
    (b'{@, "n": ', "api.malformed_json"),
]


@pytest.mark.parametrize("name", LISTENERS)
@pytest.mark.parametrize(("body", "code"), MALFORMED, ids=[c for _, c in MALFORMED])
def test_malformed_bodies_are_refused_in_the_error_format_and_create_nothing(
    listeners: dict[str, Listener], name: str, body: bytes, code: str
) -> None:
    lis = listeners[name]
    before = lis.created()
    status, _, reply = _post(lis, lis.with_fields(body))
    assert _refused_with(lis, status, reply) == code, reply
    assert lis.created() == before
    _serves_the_next_request(lis)


@pytest.mark.parametrize("name", LISTENERS)
@pytest.mark.parametrize(
    "request_bytes",
    [
        b"GET @ HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n",
        b"GET @ HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
        b"POST @ HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
        b"POST @ HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}XX0\r\n\r\n",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n",
    ],
    ids=["header-without-colon", "bad-content-length", "bad-chunk-size", "bad-chunk-end", "tls-on-plain"],
)
def test_an_unparseable_request_gets_a_json_error(
    listeners: dict[str, Listener], name: str, request_bytes: bytes
) -> None:
    lis = listeners[name]
    s = _connect(lis.where)
    s.sendall(request_bytes.replace(b"@", lis.health.encode()))
    status, headers, reply = _read_reply(s)
    assert status == 400 and headers["content-type"] == "application/json"
    assert _refused_with(lis, status, reply) == "api.bad_http_request"
    assert _closed_within(s, 5.0)
    s.close()
    _serves_the_next_request(lis)


@pytest.mark.parametrize("name", LISTENERS)
def test_garbage_pipelined_after_a_good_request_is_refused_after_its_reply(
    listeners: dict[str, Listener], name: str
) -> None:
    lis = listeners[name]
    s = _connect(lis.where)
    s.sendall(f"GET {lis.health} HTTP/1.1\r\nHost: x\r\n\r\n".encode() + b"\x00\x01 garbage \xff\r\n\r\n")
    buf = bytearray()
    assert _read_reply(s, buf)[0] == 200
    status, _, reply = _read_reply(s, buf)
    assert status == 400 and _refused_with(lis, status, reply) == "api.bad_http_request"
    assert _closed_within(s, 5.0)
    s.close()
    _serves_the_next_request(lis)


@pytest.mark.parametrize("name", LISTENERS)
def test_headers_over_16_kib_are_refused_with_431(listeners: dict[str, Listener], name: str) -> None:
    """docs/api.md's bound, also when the whole request arrives in one read (h11 only bounds what it buffers),
    and when the headers never end: the bound is passed while they are still incomplete (a large request split
    over reads is refused there, whichever way the kernel cuts it)."""
    lis = listeners[name]
    # over what h11 buffers; under it, over the bound on the parsed request; over it, and never finished
    for pad, end in ((100_000, "\r\n\r\n"), (16_500, "\r\n\r\n"), (20_000, "")):
        s = _connect(lis.where)
        s.sendall(f"GET {lis.health} HTTP/1.1\r\nHost: x\r\nX-Pad: {'p' * pad}{end}".encode())
        status, _, reply = _read_reply(s)
        assert status == 431 and _refused_with(lis, status, reply) == "api.headers_too_large"
        assert _closed_within(s, 5.0)
        s.close()
    s = _connect(lis.where)  # just under the bound still passes
    s.sendall(f"GET {lis.health} HTTP/1.1\r\nHost: x\r\nX-Pad: {'p' * 15_000}\r\n\r\n".encode())
    assert _read_reply(s)[0] == 200
    s.close()


def _mutated_bodies(fields: bytes) -> st.SearchStrategy[tuple[bytes, str | None]]:
    """A create body with a JSON value inside, then one defect that the strict parser names (None: no defect)."""
    leaves: st.SearchStrategy[object] = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**53), 2**53),
        st.text(max_size=20),
        st.floats(allow_nan=False, allow_infinity=False),
    )
    values = st.recursive(
        leaves,
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
        max_leaves=12,
    )

    def build(value: object, defect: str, n: int) -> tuple[bytes, str | None]:
        inner = json.dumps(value).encode()
        if defect == "deep":
            return b"{" + fields + b', "x": ' + b"[" * n + inner + b"]" * n + b"}", "api.too_deep"
        body = b"{" + fields + b', "x": ' + inner + b"}"
        if defect == "bom":
            return b"\xef\xbb\xbf" + body, "api.byte_order_mark"
        if defect == "duplicate":
            return b"{" + fields + b', "x": ' + inner + b', "x": 0}', "api.duplicate_key"
        if defect == "not-utf8":
            return b"{" + fields + b', "s": "\xc3\x28", "x": ' + inner + b"}", "api.malformed_json"
        if defect == "truncated":
            return body[: max(1, n % len(body))], "api.malformed_json"
        return body, None

    return st.builds(
        build,
        values,
        st.sampled_from(["none", "deep", "bom", "duplicate", "not-utf8", "truncated"]),
        st.integers(32, 400),
    )


@pytest.mark.parametrize("name", LISTENERS)
def test_any_body_gets_the_strict_parsers_verdict_and_the_listener_lives_on(
    listeners: dict[str, Listener], name: str
) -> None:
    lis = listeners[name]

    @settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(_mutated_bodies(lis.fields))
    def case(case: tuple[bytes, str | None]) -> None:
        body, defect = case
        before = lis.created()
        status, _, reply = _post(lis, body)
        assert 400 <= status < 500, (status, reply)
        code = _refused_with(lis, status, reply)
        if defect is not None:
            assert code == defect, (body[:200], reply)
            assert lis.created() == before
        _serves_the_next_request(lis)

    case()


@pytest.mark.parametrize("name", LISTENERS)
def test_a_listener_out_of_descriptors_keeps_running_and_serves_once_they_are_freed(
    listeners: dict[str, Listener], name: str
) -> None:
    """No listener caps its connections (docs/decisions.md): the process's descriptor limit does. At that limit
    the event loop pauses accepting and retries; nothing crashes, and once the attackers' connections are gone
    (closed by them or by the header deadline) the next good request is served."""
    lis = listeners[name]
    pid = _pid(lis.proc)
    soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    in_use = len(os.listdir(f"/proc/{pid}/fd"))
    flood: list[socket.socket] = []
    try:
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (in_use + 16, hard))
        for _ in range(64):
            try:
                s = _connect(lis.where)  # the kernel completes the handshake; the server runs out of descriptors
            except OSError:  # its backlog is full too: saturated
                break
            flood.append(s)
            with contextlib.suppress(OSError):  # at its limit a listener may close what it accepted: its right
                s.sendall(f"GET {lis.health} HTTP/1.1\r\nHost: x\r\n".encode())
        assert poll(lambda: len(os.listdir(f"/proc/{pid}/fd")) >= in_use + 16, 10, what="the listener at its limit")
        for s in flood:
            s.close()
        flood.clear()
        assert poll(lambda: _health_status(lis) == 200, 20, what="a good request served after the flood")
    finally:
        for s in flood:
            s.close()
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))
    assert lis.proc.proc.poll() is None  # type: ignore[attr-defined]


def test_anonymous_envd_health_makes_no_admin_lookup_and_says_nothing_of_the_id(
    listeners: dict[str, Listener],
) -> None:
    """Without the sandbox's access token nothing is looked up with the front door's admin key, and every id —
    taken or free, well-formed or not — gets the same answer."""
    front = listeners["frontdoor"]
    audit: Path = listeners["master"].proc.audit_log  # type: ignore[attr-defined]
    before = audit.read_text().count("\n")
    answers = set()
    for sid in ("sb-0123456789abcdef", "t0123456789ab-anything", "no/such id"):
        s = _connect(front.where)
        s.sendall(f"GET /health HTTP/1.1\r\nHost: x\r\nE2b-Sandbox-Id: {sid}\r\n\r\n".encode())
        status, _, body = _read_reply(s)
        s.close()
        answers.add((status, body.replace(sid.encode(), b"ID")))
    assert len(answers) == 1 and next(iter(answers))[0] == 401, answers
    assert audit.read_text().count("\n") == before, "the front door looked the id up as the admin"


def test_listeners_still_answer_after_the_attacks(listeners: dict[str, Listener]) -> None:
    for lis in listeners.values():
        _serves_the_next_request(lis)
