"""The plain-http front door (a real `cubeaccel api serve`): HTTP/1.1, and HTTP/2 with prior knowledge (h2c), as
docs/e2b.md says; an HTTP/1.1 request asking `Upgrade: h2c` is answered in HTTP/1.1, never switched (101), so a
proxy that passes Upgrade headers on cannot hand its client an h2c tunnel past itself."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.frontdoor_process import FrontDoorProcess

# HTTP2-Settings: an empty SETTINGS payload, base64url (RFC 7540 §3.2.1), as a real h2c client sends it
UPGRADE = (
    b"GET /health HTTP/1.1\r\nHost: api.test\r\nConnection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
    b"HTTP2-Settings: \r\n\r\n"
)


@pytest.fixture(scope="module")
def front(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FrontDoorProcess]:
    base: Path = tmp_path_factory.mktemp("h2c")
    f = FrontDoorProcess(base, "http://127.0.0.1:9", "e2b_" + "0" * 72).start()  # /health needs no CubeMaster
    try:
        yield f
    finally:
        f.stop()


def test_an_upgrade_to_h2c_is_answered_in_http_1_1(front: FrontDoorProcess) -> None:
    with socket.create_connection(("127.0.0.1", front.port), timeout=10) as s:
        s.sendall(UPGRADE)
        reply = b""
        while b"\r\n\r\n" not in reply:
            chunk = s.recv(4096)
            assert chunk, reply
            reply += chunk
    status = reply.split(b"\r\n", 1)[0]
    assert status == b"HTTP/1.1 200 ", reply  # not "101 Switching Protocols"
    assert b"upgrade: h2c" not in reply.lower()


def test_http2_with_prior_knowledge_is_served(front: FrontDoorProcess) -> None:
    with httpx.Client(http1=False, http2=True, timeout=10) as c:
        r = c.get(f"{front.url}/health")
    assert (r.status_code, r.http_version) == (200, "HTTP/2")


def test_plain_http_1_1_is_served(front: FrontDoorProcess) -> None:
    r = httpx.get(f"{front.url}/health", timeout=10)
    assert (r.status_code, r.http_version) == (200, "HTTP/1.1")
