"""The Cubelet's status push: each status arrives signed at the sandbox's status route; a failing CubeMaster (5xx)
is asked again, one that does not know the sandbox (4xx) is not."""

from __future__ import annotations

import json
import secrets
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from cubeaccel.cubelet.status_push import RETRIES, StatusPush
from cubeaccel.transport import node_sig
from cubeaccel.wire.master_api import StatusBody, StatusError
from tests.support.poll import poll


class _Master(ThreadingHTTPServer):
    puts: list[tuple[str, dict[str, Any], bool]]  # path, body, signature valid
    answers: dict[str, int]  # sandbox id → the status CubeMaster answers its push with
    token: str
    nonces: node_sig.NonceCache


def _handler(server: _Master) -> type[BaseHTTPRequestHandler]:
    class H(BaseHTTPRequestHandler):
        def do_PUT(self) -> None:
            raw = self.rfile.read(int(self.headers["content-length"]))
            claim = node_sig.parse(self.headers["authorization"], self.headers[node_sig.BODY_HEADER])
            signed = claim is not None and node_sig.check(claim, server.token, "PUT", self.path, server.nonces) is None
            server.puts.append((self.path, json.loads(raw), signed))
            code = server.answers.get(self.path.split("/")[5], 200)
            self.send_response(code)
            self.send_header("content-type", "application/json")
            self.end_headers()
            if code >= 500:  # a proxy's page, not CubeMaster's error
                self.wfile.write(b"<html>busy</html>")
                return
            body = {"state": "running"} if code < 300 else {"error": {"code": "sandbox.not_found", "message": "x"}}
            self.wfile.write(json.dumps(body).encode())

        def log_message(self, *args: Any) -> None:
            pass

    return H


@pytest.fixture
def master() -> Iterator[_Master]:
    m = _Master(("127.0.0.1", 0), BaseHTTPRequestHandler)
    m.puts, m.answers, m.token = [], {}, f"cbn:n-push:1:{secrets.token_hex(16)}"
    m.nonces = node_sig.NonceCache()
    m.RequestHandlerClass = _handler(m)
    threading.Thread(target=m.serve_forever, daemon=True).start()
    yield m
    m.shutdown()


def test_a_status_arrives_signed_and_a_refused_one_is_not_asked_again(master: _Master) -> None:
    run = secrets.token_hex(4)
    ok, gone = f"sb-ok-{run}", f"sb-gone-{run}"
    master.answers[gone] = 404
    push = StatusPush(f"http://127.0.0.1:{master.server_address[1]}", "n-push", token=lambda: master.token)
    push.start()
    try:
        failed = StatusBody(phase="failed", error=StatusError(code="guest.validation_failed", layer="guest"))
        push.push(gone, failed)
        push.push(ok, StatusBody(phase="running"))
        poll(lambda: push.delivered == 1)
        paths = [p for p, _, _ in master.puts]
        assert paths == [f"/v1/nodes/n-push/sandboxes/{gone}/status", f"/v1/nodes/n-push/sandboxes/{ok}/status"]
        assert [b["phase"] for _, b, _ in master.puts] == ["failed", "running"]
        assert master.puts[0][1]["error"]["code"] == "guest.validation_failed"
        assert all(signed for _, _, signed in master.puts)
    finally:
        push.stop()


def test_a_failing_master_is_asked_again_up_to_the_bound(master: _Master) -> None:
    sid = f"sb-down-{secrets.token_hex(4)}"
    master.answers[sid] = 503
    push = StatusPush(f"http://127.0.0.1:{master.server_address[1]}", "n-push", token=lambda: master.token)
    push.start()
    try:
        push.push(sid, StatusBody(phase="running"))
        poll(lambda: len(master.puts) == RETRIES, deadline_s=RETRIES * 2.0)
        assert push.delivered == 0
    finally:
        push.stop()
