"""Cubelet started with --master heartbeats its capacity to a real HTTP server.

The test starts its own Cubelet: it needs `--master` pointing at this test's server and a fresh event log."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

from cubeaccel.transport import node_sig
from tests.support.cubelet_process import CubeletProcess
from tests.support.poll import poll


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Master(ThreadingHTTPServer):
    beats: list[tuple[str, dict[str, Any]]]
    auth: list[tuple[str, str, str, bytes]]  # path, authorization, body digest header, body
    up: bool


def _handler(server: _Master) -> type[BaseHTTPRequestHandler]:
    class H(BaseHTTPRequestHandler):
        def do_PUT(self) -> None:
            raw = self.rfile.read(int(self.headers["content-length"]))
            server.beats.append((self.path, json.loads(raw)))
            server.auth.append((self.path, self.headers["authorization"], self.headers[node_sig.BODY_HEADER], raw))
            code = 200 if server.up else 503
            self.send_response(code)
            self.send_header("content-type", "application/json")
            self.end_headers()
            self.wfile.write(json.dumps({"node": self.path.split("/")[3], "state": "ready"}).encode())  # the ack

        def log_message(self, *args: Any) -> None:
            pass

    return H


def test_heartbeat_carries_the_capacity_summary_and_losing_the_master_is_one_event(tmp_path: Path) -> None:
    master = _Master(("127.0.0.1", 0), BaseHTTPRequestHandler)
    master.beats, master.auth, master.up = [], [], True
    master.RequestHandlerClass = _handler(master)
    threading.Thread(target=master.serve_forever, daemon=True).start()
    port = _free_port()
    url = f"http://127.0.0.1:{master.server_address[1]}"
    p = CubeletProcess(tmp_path, "2xh100,2xt4", "--master", url, "--listen", f"127.0.0.1:{port}", "--node", "n7")
    p.start()
    try:
        path, body = poll(lambda: master.beats[-1] if master.beats else None)
        assert path == "/v1/nodes/n7"
        assert body["cubelet_url"] == f"http://127.0.0.1:{port}"
        assert body["capacity"]["total"] == 4 and body["capacity"]["allocatable"] == 4
        assert {g["labels"]["model"] for g in body["capacity"]["groups"]} == {"H100-PCIe-80GB", "T4-16GB"}
        assert body["pinnable_memory_mib"] > 0
        # The TCP listener serves CubeMaster's calls (its node token; device verbs it forwards for an admin),
        # but never shim evidence.
        base = f"http://127.0.0.1:{port}"
        assert p.token is not None
        nonces = node_sig.NonceCache()
        for path_, header, sha, raw in list(master.auth):  # every heartbeat signed with the node's token, not it
            claim = node_sig.parse(header, sha)
            assert claim is not None and p.token not in header
            assert node_sig.check(claim, p.token, "PUT", path_, nonces) is None and node_sig.body_matches(claim, raw)
        assert httpx.get(f"{base}/v1/devices").json()["error"]["code"] == "auth.missing_credential"
        wrong = {"Authorization": "Bearer cbn:n7:1:" + "0" * 64}
        assert httpx.get(f"{base}/v1/devices", headers=wrong).json()["error"]["code"] == "auth.invalid_credential"
        assert httpx.delete(f"{base}/v1/reservations/sb", headers=wrong).status_code == 401
        bearer = {"Authorization": f"Bearer {p.token}"}  # the token itself: never accepted, only its signature
        assert httpx.get(f"{base}/v1/devices", headers=bearer).json()["error"]["code"] == "auth.invalid_credential"
        for _ in range(16):  # 20 failures from this source so far
            assert httpx.get(f"{base}/v1/devices", headers=wrong).status_code == 401
        assert httpx.get(f"{base}/v1/devices", headers=wrong).json()["error"]["code"] == "auth.throttled"
        h = node_sig.NodeAuth(p.token)
        r = httpx.post(f"{base}/v1/shim-reports", json={"sandbox_id": "x", "kind": "vmm_exited"}, auth=h)
        assert r.status_code in (404, 405) and r.json()["error"]["code"].startswith("api.")
        dev = p.client.devices()[0].id
        r = httpx.post(f"{base}/v1/devices/{dev}/recover", json={"who": "a", "reason": "b"}, auth=h)
        assert r.json()["error"]["code"] == "operator.not_recoverable"  # reached the verb: it is allocatable
        r = httpx.post(f"{base}/v1/devices/{dev}/quarantine", json={"who": "a", "reason": "b"}, headers=wrong)
        assert r.status_code == 429 and p.client.devices()[0].state == "allocatable"
        assert httpx.get(f"{base}/v1/devices", auth=h).status_code == 200
        p.client.reserve("sb", 1)
        poll(lambda: master.beats[-1][1]["capacity"]["allocatable"] == 3)
        master.up = False
        poll(lambda: any(e.kind == "master_unreachable" for e in p.client.events().events))
        n = len(master.beats)
        poll(lambda: len(master.beats) > n + 1)  # keeps trying
        kinds = [e.kind for e in p.client.events().events]
        assert kinds.count("master_unreachable") == 1  # a change, not a flood
        assert kinds.index("master_reachable") < kinds.index("master_unreachable")  # the ack read, then lost
    finally:
        p.stop()
        master.shutdown()


def test_the_first_heartbeat_comes_from_a_cubelet_that_answers(tmp_path: Path) -> None:
    """A heartbeat says the node is ready: CubeMaster (and `up`) may call it at once. So the Cubelet sends its
    first one only once both listeners accept connections; this master tries both before it answers the beat."""
    port = _free_port()
    seen: list[tuple[bool, bool]] = []

    def answers(connect: Any) -> bool:
        try:
            connect().close()
            return True
        except OSError:
            return False

    def unix() -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(str(tmp_path / "cubelet.sock"))
        return s

    class Probing(BaseHTTPRequestHandler):
        def do_PUT(self) -> None:
            self.rfile.read(int(self.headers["content-length"]))
            if not seen:
                seen.append((answers(lambda: socket.create_connection(("127.0.0.1", port), 1)), answers(unix)))
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.end_headers()
            self.wfile.write(json.dumps({"node": self.path.split("/")[3], "state": "ready"}).encode())  # the ack

        def log_message(self, *args: Any) -> None:
            pass

    master = ThreadingHTTPServer(("127.0.0.1", 0), Probing)
    threading.Thread(target=master.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{master.server_address[1]}"
    p = CubeletProcess(tmp_path, "h100x1", "--master", url, "--listen", f"127.0.0.1:{port}", "--node", "n8")
    p.start()
    try:
        assert poll(lambda: seen[0] if seen else None) == (True, True)
    finally:
        p.stop()
        master.shutdown()
