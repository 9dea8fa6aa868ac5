"""JSON logs, request ids and the cold-start timeline: the parts of observability that need no second process."""

from __future__ import annotations

import contextvars
import io
import json
import logging
import socketserver
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from cubeaccel.cubelet.metrics import CubeletMetrics
from cubeaccel.cubelet.server import create_app as cubelet_app
from cubeaccel.master.auth import ADMIN
from cubeaccel.master.server import create_app as master_app
from cubeaccel.master.service import CubeMaster
from cubeaccel.master.store import MasterStore
from cubeaccel.model.cold_start import cold_start_phases
from cubeaccel.model.event_kinds import EventKind
from cubeaccel.model.states import Actor, DeviceEvent
from cubeaccel.shim.reporter import Reporter
from cubeaccel.transport.telemetry import REDACTED, configure_logging, log_fields, parse_level, set_request_id
from cubeaccel.wire.reports import ShimExiting, VmStarted
from tests.support.cubelet_harness import Node


@pytest.fixture
def logs() -> Iterator[io.StringIO]:
    buf = io.StringIO()
    configure_logging("info", stream=buf)
    yield buf
    logging.getLogger("cubeaccel").handlers.clear()


def lines(buf: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(x) for x in buf.getvalue().splitlines()]


def test_phases_follow_the_latest_start_and_add_up_to_the_total() -> None:
    first = [("reservation_created", None, 1.0), ("transition", "prepare", 2.0), ("sandbox_running", None, 9.0)]
    second = [
        ("reservation_created", None, 100.0),
        ("transition", "reserve", 100.0),
        ("transition", "prepare", 100.5),
        ("shim_report", "vm_started", 101.0),
        ("shim_report", "guest_ready", 103.0),  # no pinning asked: no pin phase, boot counts from vm_started
        ("shim_report", "device_attached", 103.2),
        ("shim_report", "device_attached", 103.5),  # the last device counts
        ("shim_report", "guest_validated", 104.0),
        ("sandbox_running", None, 104.25),
    ]
    got = cold_start_phases(first + second)
    assert got == {
        "reserve": 0.5,
        "vm_start": 0.5,
        "guest_boot": 2.0,
        "hotplug": 0.5,
        "guest_validation": 0.5,
        "ready": 0.25,
        "total": 4.25,
    }
    assert sum(v for k, v in got.items() if k != "total") == pytest.approx(got["total"])
    assert cold_start_phases(second[:-1]) == {}  # not running yet: no timeline
    assert cold_start_phases([]) == {}


def test_a_log_line_is_one_json_object_and_credentials_are_redacted(logs: io.StringIO) -> None:
    log = logging.getLogger("cubeaccel.test")
    log_fields(log, logging.INFO, "hello", node="n1", token="s3cret-token", details={"api_key": "s3cret-key", "n": 1})
    log_fields(log, logging.DEBUG, "quiet")  # below the level: nothing
    (line,) = lines(logs)
    assert line["msg"] == "hello" and line["level"] == "info" and line["node"] == "n1"
    assert line["token"] == REDACTED and line["details"] == {"api_key": REDACTED, "n": 1}
    assert "s3cret" not in logs.getvalue()


def test_the_level_is_a_plain_parameter() -> None:
    assert parse_level("warning") == logging.WARNING and parse_level("DEBUG") == logging.DEBUG
    with pytest.raises(ValueError, match="unknown log level"):
        parse_level("chatty")
    buf = io.StringIO()
    configure_logging("error", stream=buf)
    try:
        logging.getLogger("cubeaccel.x").warning("not shown")
        logging.getLogger("cubeaccel.x").error("shown")
    finally:
        logging.getLogger("cubeaccel").handlers.clear()
    assert [x["msg"] for x in lines(buf)] == ["shown"]


def test_every_request_is_one_line_with_its_route_and_id_and_no_credential(logs: io.StringIO, tmp_path: Path) -> None:
    master = CubeMaster(MasterStore(str(tmp_path / "m.db")))
    _, admin = master.auth.create_key(ADMIN)
    api = TestClient(master_app(master), raise_server_exceptions=False)
    auth = {"Authorization": f"Bearer {admin}"}
    r = api.post("/v1/tenants", json={"name": "t1"}, headers={**auth, "X-Request-Id": "req-1"})
    assert r.status_code == 201 and r.headers["x-request-id"] == "req-1"
    tenant_key = r.json()["key"]
    assert api.get("/v1/tenants/t1/nope", headers=auth).status_code == 404  # no such route: one line too
    assert api.get("/v1/nodes", headers={"Authorization": "Bearer cbk:forged"}).status_code == 401
    requests = [x for x in lines(logs) if x["msg"] == "request"]
    assert [(x["route"], x["status"]) for x in requests] == [
        ("/v1/tenants", 201),
        ("unmatched", 404),
        ("/v1/nodes", 401),
    ]
    assert requests[0]["request_id"] == "req-1" and requests[1]["request_id"] != "req-1"
    assert requests[2]["error_code"].startswith("auth.")
    for secret in (admin, tenant_key, "cbk:forged"):
        assert secret not in logs.getvalue()
    master.store.close()


def test_the_request_id_goes_into_the_shim_spec_and_onto_transition_lines(logs: io.StringIO, tmp_path: Path) -> None:
    node = Node.create(tmp_path, "2xh100")
    node.shim.slow_start.add("sb-rid")  # the spec stays with the driver, as a real shim's spec file would
    api = TestClient(cubelet_app(node.cubelet), raise_server_exceptions=False)
    body = {"sandbox_id": "sb-rid", "count": 1, "start": True}
    r = api.post("/v1/reservations", json=body, headers={"X-Request-Id": "create-42"})
    assert r.status_code == 201, r.text
    assert node.shim._pending["sb-rid"].request_id == "create-42"
    moved = [x for x in lines(logs) if x["msg"] == "transition" and x.get("sandbox_id") == "sb-rid"]
    assert [(x["event"], x["request_id"]) for x in moved] == [("reserve", "create-42"), ("prepare", "create-42")]
    node.cubelet.store.close()


def _samples(registry: CollectorRegistry, name: str) -> dict[frozenset[tuple[str, str]], float]:
    return {frozenset(s.labels.items()): s.value for f in registry.collect() for s in f.samples if s.name == name}


def test_counters_come_from_committed_events_only_and_scrubs_are_timed(tmp_path: Path) -> None:
    node = Node.create(tmp_path, "2xh100")
    m = CubeletMetrics(node.cubelet)
    dev = node.cubelet.store.devices()[0]
    with pytest.raises(RuntimeError), node.cubelet.store.tx() as t:  # a change that rolls back counts nothing
        t.transition(dev, DeviceEvent.QUARANTINE, Actor.OPERATOR, reason="operator.quarantine")
        raise RuntimeError("abandoned")
    assert _samples(m.registry, "cubeaccel_device_quarantines_total") == {}
    with node.cubelet.store.tx() as t:
        t.transition(dev, DeviceEvent.QUARANTINE, Actor.OPERATOR, reason="operator.quarantine")
        t.event(EventKind.SCRUB_FINISHED, Actor.CUBELET, device_id=dev.id, details={"ok": False, "duration_s": 1.5})
    quarantines = _samples(m.registry, "cubeaccel_device_quarantines_total")
    assert quarantines == {frozenset({("reason", "operator.quarantine")}): 1}
    scrubs = _samples(m.registry, "cubeaccel_scrub_duration_seconds_sum")
    assert scrubs == {frozenset({("class", "gpu"), ("outcome", "failed")}): 1.5}
    node.cubelet.store.close()


class _Headers(BaseHTTPRequestHandler):
    seen: list[str | None] = []

    def do_POST(self) -> None:
        _Headers.seen.append(self.headers.get("X-Request-Id"))
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        self.send_response(202)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *_: object) -> None:
        return None


class _UnixHttp(socketserver.UnixStreamServer):
    def get_request(self) -> tuple[Any, Any]:
        conn, _ = super().get_request()
        return conn, ("local", 0)


def test_a_shim_sends_its_spec_request_id_with_every_report(tmp_path: Path) -> None:
    sock = tmp_path / "c.sock"
    server = _UnixHttp(str(sock), _Headers)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        ctx = contextvars.copy_context()  # the shim adopts its spec's id for the whole process: a context here
        ctx.run(set_request_id, "create-7")
        ctx.run(Reporter("sb-1", sock, None, tmp_path).report, VmStarted())
        Reporter("sb-1", sock, None, tmp_path).report(ShimExiting())  # outside: none
    finally:
        server.shutdown()
        server.server_close()
    assert _Headers.seen == ["create-7", None]
