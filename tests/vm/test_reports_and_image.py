"""Reports over Cubelet's unix-socket HTTP API (a tiny real server), and the image cache."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from socketserver import UnixStreamServer
from typing import Any

import pytest

from cubeaccel.images.builder import build, cache_dir
from cubeaccel.images.manifest import Manifest
from tests.support.poll import poll

pytestmark = pytest.mark.vm


class _UnixHTTPServer(UnixStreamServer, HTTPServer):
    def server_bind(self) -> None:  # HTTPServer.server_bind expects (host, port)
        UnixStreamServer.server_bind(self)
        self.server_name, self.server_port = "cubelet", 0


def _serve(path: Path, received: list[dict[str, Any]]) -> _UnixHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            received.append({"path": self.path, **body})
            self.send_response(202)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args: object) -> None:
            pass

        def address_string(self) -> str:
            return "cubelet-test"

    server = _UnixHTTPServer(str(path), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_reports_are_posted_to_cubelet_over_its_unix_socket(shim_factory: Any, tmp_path: Path) -> None:
    received: list[dict[str, Any]] = []
    sock = tmp_path / "cubelet.sock"
    server = _serve(sock, received)
    try:
        run = shim_factory(start="template", report={"socket": str(sock)}).start()
        poll(lambda: any(r["kind"] == "guest_validated" for r in received), 60)
        assert run.terminate() == 0
    finally:
        server.shutdown()
        server.server_close()
    assert {r["path"] for r in received} == {"/v1/shim-reports"}
    assert [r["kind"] for r in received] == [
        "vm_started",
        "vmm_confined",
        "memory_pinned",
        "guest_ready",
        "device_attached",
        "guest_validated",
        "device_detached",
        "vmm_exited",
        "shim_exiting",
    ]
    assert all(r["sandbox_id"] == run.sandbox_id for r in received)
    assert not (run.state_dir / "undelivered.jsonl").exists()


def test_image_is_reused_until_an_input_changes(guest_image: Manifest) -> None:
    first, _ = build()  # the session image, unless a source file changed since (shared working trees)
    again, built = build()
    assert not built
    assert again.image_digest == first.image_digest
    assert again.verify() == []
    assert guest_image.directory.parent == cache_dir() / "images"
    doc = json.loads((guest_image.directory / "manifest.json").read_text())
    assert doc["kernel"]["release"] == doc["modules_img"]["kernel_release"]
    assert doc["kernel"]["package"] == f"linux-image-{doc['kernel']['release']}"
    assert {"virtio_console", "virtio_pci"} <= set(doc["modules_img"]["modules"])
