"""A stream cut upstream (a sandbox killed mid-command) reaches the caller as a reset connection, through the real
Hypercorn the front door runs under: the SDK (pyqwest, 2.45 on) reads a reset as a dropped connection and probes
the sandbox's health, where a FIN after a partial chunked body would be a protocol error to it."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from collections.abc import Iterator

import httpx
import pyqwest
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from cubeaccel.frontdoor import envd
from cubeaccel.frontdoor.envd import relayed
from cubeaccel.frontdoor.serve import expose_client_sockets
from tests.support.master_harness import free_port
from tests.support.poll import poll

SERVER_LOG = "tests.hypercorn.error"
HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/connect+json\r\nTransfer-Encoding: chunked\r\n\r\n"


def cutting_upstream() -> tuple[socket.socket, int]:
    """Sends one chunk of a streamed reply, then goes away (as a killed sandbox's channel does)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)

    def serve() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            conn.recv(65536)
            conn.sendall(HEAD + b"5\r\nfirst\r\n")
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    return srv, srv.getsockname()[1]


@pytest.fixture
def front(request: pytest.FixtureRequest) -> Iterator[str]:
    from hypercorn.asyncio import serve
    from hypercorn.config import Config

    upstream_sock, upstream_port = cutting_upstream()

    async def relay(req: Request) -> Response:
        client = httpx.AsyncClient()
        up = await client.send(client.build_request("GET", f"http://127.0.0.1:{upstream_port}/"), stream=True)
        return relayed(up, req.scope["http_version"])

    app = Starlette(routes=[Route("/stream", relay)])
    port = free_port()
    cfg = Config()
    cfg.bind = [f"127.0.0.1:{port}"]
    cfg.accesslog = None
    cfg.errorlog = logging.getLogger(SERVER_LOG)  # what the server says, for the test to read
    expose_client_sockets()
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    thread = threading.Thread(
        target=lambda: loop.run_until_complete(serve(app, cfg, shutdown_trigger=stop.wait)),  # type: ignore[arg-type]
        daemon=True,
    )
    thread.start()
    deadline = loop.time() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert loop.time() < deadline, "hypercorn did not start"
            threading.Event().wait(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(10)
        upstream_sock.close()


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def logs() -> Iterator[Records]:
    """The front door's and the server's records, straight from their loggers: another test's logging setup
    may keep `cubeaccel` records from reaching the root logger (and caplog)."""
    records = Records()
    loggers = [logging.getLogger(name) for name in (envd.__name__, SERVER_LOG)]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.INFO)
        lg.addHandler(records)
    try:
        yield records
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.removeHandler(records)
            lg.setLevel(level)


def test_a_stream_cut_upstream_is_a_reset_for_the_caller(front: str, logs: Records) -> None:
    got = bytearray()
    with pytest.raises(pyqwest.ReadError) as cut, pyqwest.SyncClient().stream("GET", f"{front}/stream") as r:
        for chunk in r.content:
            got.extend(chunk)
    assert bytes(got) == b"first"
    assert "reset" in str(cut.value).lower()

    # A designed cut is one line of the front door's, not the server's traceback of an app error. The caller sees
    # the reset before the server's task logs it: wait for the line, then check there is exactly one.
    def cut_lines() -> list[logging.LogRecord]:
        return [r for r in logs.records if r.name == envd.__name__ and "stream cut" in r.getMessage()]

    cuts = poll(cut_lines, 20.0, what="the front door's stream-cut line")
    assert len(cuts) == 1 and "GET /stream" in cuts[0].getMessage()
    assert not [r for r in logs.records if r.name == SERVER_LOG and r.levelno >= logging.ERROR]
