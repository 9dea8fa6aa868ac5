"""Metrics and logs of a real stack (CubeMaster + one Cubelet process): /metrics scraped and parsed with
prometheus_client's own parser before and after a sandbox's whole life; JSON log lines with one request id
across both processes; no credential in any log."""

from __future__ import annotations

import json
import secrets
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.support.master_harness import Cluster
from tests.support.poll import poll

PROFILES = {"a": "2xh100"}
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sum over the series of `name` whose labels include `labels` (0 when there is none yet)."""
    want = set(labels.items())
    return sum(v for (n, lb), v in samples.items() if n == name and want <= lb)


def delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


class Scraper:
    def __init__(self, c: Cluster) -> None:
        self.master_url = c.master.url
        self.admin = {"Authorization": f"Bearer {c.master.admin_key}"}
        node = next(n for n in c.c.nodes() if n.node == "a")
        self.cubelet_url = node.cubelet_url

    def master(self) -> Samples:
        r = httpx.get(f"{self.master_url}/metrics", headers=self.admin)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain"), r.text
        return parse(r.text)

    def cubelet(self) -> Samples:
        r = httpx.get(f"{self.cubelet_url}/metrics")  # no node token: a scraper holds none (docs/decisions.md)
        assert r.status_code == 200, r.text
        return parse(r.text)


def log_lines(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def has(lines: list[dict[str, Any]], **fields: Any) -> bool:
    return any(all(x.get(k) == v for k, v in fields.items()) for x in lines)


def heartbeat_landed(c: Cluster, allocatable: int) -> None:
    """Wait for the event CubeMaster's device metrics follow: a heartbeat from node a that counts `allocatable`
    devices, with no claim of CubeMaster's own still pending on top of it. A claim clears when the sandbox
    starts, which can be before the next heartbeat: until then CubeMaster still holds the older summary."""

    def landed() -> bool:
        node = next(n for n in c.c.nodes() if n.node == "a")
        return node.allocatable == allocatable and all(g.claimed == 0 for g in node.groups)

    poll(landed, 30, what=f"a heartbeat counting {allocatable} allocatable")


def test_metrics_move_by_a_sandbox_lifecycle_and_logs_follow_one_request_id(c: Cluster) -> None:
    m = Scraper(c)
    cub = c.cubelets["a"].client
    heartbeat_landed(c, allocatable=2)
    m0, k0 = m.master(), m.cubelet()
    assert value(k0, "cubeaccel_devices", Hostname="a", state="allocatable", modelName="H100-PCIe-80GB") == 2
    assert value(k0, "cubeaccel_device_state", Hostname="a", state="allocatable") == 2
    assert value(m0, "cubeaccel_node_devices", Hostname="a", kind="allocatable") == 2

    rid = f"test-{secrets.token_hex(6)}"
    body = {"gpu": "H100:1", "id": f"obs-{secrets.token_hex(4)}"}
    r = httpx.post(f"{c.master.url}/v1/sandboxes", json=body, headers={**m.admin, "X-Request-Id": rid}, timeout=60)
    assert r.status_code == 201, r.text
    assert r.headers["x-request-id"] == rid
    sid = r.json()["id"]
    poll(lambda: c.c.sandbox(sid).state == "running", 30, what="sandbox running")
    k1 = m.cubelet()
    assert value(k1, "cubeaccel_devices", Hostname="a", state="attached") == 1
    assert value(k1, "cubeaccel_devices", Hostname="a", state="allocatable") == 1
    attached = [lb for (n, lb), v in k1.items() if n == "cubeaccel_device_state" and ("state", "attached") in lb]
    assert len(attached) == 1 and dict(attached[0])["pci_bus_id"].count(":") == 2  # 00000000:BB:DD.F, DCGM's form
    heartbeat_landed(c, allocatable=1)
    m1 = m.master()
    assert value(m1, "cubeaccel_node_devices", Hostname="a", kind="allocatable") == 1

    c.c.delete(sid)
    poll(lambda: c.c.sandbox(sid).state == "deleted", 30, what="sandbox deleted")
    poll(lambda: all(d.state == "allocatable" for d in cub.devices()), 30, what="devices back")
    poll(lambda: delta(k0, m.cubelet(), "cubeaccel_reservations_total", outcome="closed") == 1, 10, what="closed")

    refused = c.refused({"gpu": "H100:5"})  # more than the node has: unschedulable
    assert refused.code == "schedule.unschedulable"
    assert httpx.get(f"{c.master.url}/v1/nodes").status_code == 401  # no credential
    device = cub.devices()[0].id
    cub.verb(device, "quarantine", "tests", "metrics check")

    m2, k2 = m.master(), m.cubelet()
    # CubeMaster: one create placed, one refused; the decisions and their rejections; requests and denials
    assert delta(m0, m2, "cubeaccel_sandbox_creates_total", outcome="created") == 1
    assert delta(m0, m2, "cubeaccel_sandbox_creates_total", outcome="refused", reason="schedule.unschedulable") == 1
    assert delta(m0, m2, "cubeaccel_scheduler_decisions_total", outcome="placed") == 1
    assert delta(m0, m2, "cubeaccel_scheduler_decisions_total", outcome="unschedulable") == 1
    assert delta(m0, m2, "cubeaccel_scheduler_rejections_total", reason="insufficient_devices") == 1
    assert delta(m0, m2, "cubeaccel_scheduler_decision_seconds_count") == 2
    assert delta(m0, m2, "cubeaccel_api_requests_total", route="/v1/sandboxes", method="POST", status="201") == 1
    assert delta(m0, m2, "cubeaccel_api_requests_total", route="/v1/sandboxes", method="POST", status="409") == 1
    assert delta(m0, m2, "cubeaccel_api_requests_total", route="/v1/sandboxes/{sandbox_id}", method="DELETE") == 1
    assert delta(m0, m2, "cubeaccel_auth_denials_total", code="auth.missing_credential") == 1
    assert delta(m0, m2, "cubeaccel_sandbox_transitions_total", to_state="running") == 1
    assert delta(m0, m2, "cubeaccel_sandbox_transitions_total", to_state="deleted") == 1
    # Cubelet: one reservation created and closed, one start that ran, each device transition once
    assert delta(k0, k2, "cubeaccel_reservations_total", outcome="created") == 1
    assert delta(k0, k2, "cubeaccel_reservations_total", outcome="closed") == 1
    assert delta(k0, k2, "cubeaccel_sandbox_starts_total", outcome="running") == 1
    for event, actor in [
        ("reserve", "cubelet"),
        ("prepare", "cubelet"),
        ("attach_succeeded", "shim"),
        ("teardown", "cubelet"),
        ("release_confirmed", "cubelet"),
        ("revalidated", "cubelet"),
    ]:
        assert delta(k0, k2, "cubeaccel_device_transitions_total", event=event, actor=actor) == 1, event
    assert delta(k0, k2, "cubeaccel_device_transitions_total", event="quarantine", actor="operator") == 1
    assert delta(k0, k2, "cubeaccel_device_quarantines_total", reason="operator.quarantine") == 1
    for phase in ("reserve", "vm_start", "pin", "guest_boot", "hotplug", "guest_validation", "total"):
        assert delta(k0, k2, "cubeaccel_cold_start_phase_seconds_count", phase=phase) == 1, phase
    total = delta(k0, k2, "cubeaccel_cold_start_phase_seconds_sum", phase="total")
    parts = sum(
        delta(k0, k2, "cubeaccel_cold_start_phase_seconds_sum", phase=p)
        for p in ("reserve", "vm_start", "pin", "guest_boot", "hotplug", "guest_validation", "ready")
    )
    assert total > 0 and abs(total - parts) < 1e-6  # the phases add up to the whole
    assert delta(k0, k2, "cubeaccel_release_duration_seconds_count") == 1
    assert delta(k0, k2, "cubeaccel_api_requests_total", route="/v1/reservations", method="POST", status="201") == 1
    assert value(k2, "cubeaccel_devices", Hostname="a", state="quarantined") == 1
    assert value(k2, "cubeaccel_device_state", state="quarantined", reason="operator.quarantine") == 1
    assert sid not in "".join(str(k) for k in k2)  # no sandbox (tenant) names in a Cubelet's metrics

    # Logs: one JSON line per request and per transition, the create's id in both processes; no credential
    master_log = log_lines(c.master.state_dir / "master.log")
    cubelet_log = log_lines(c.cubelets["a"].state_dir / "cubelet.log")
    assert has(master_log, msg="request", request_id=rid, route="/v1/sandboxes", status=201)
    assert has(master_log, msg="sandbox_transition", request_id=rid, sandbox_id=sid, to_state="running")
    assert has(cubelet_log, msg="request", request_id=rid, route="/v1/reservations", status=201)
    assert has(cubelet_log, msg="transition", request_id=rid, sandbox_id=sid, event="reserve", to_state="reserved")
    assert has(cubelet_log, msg="transition", event="quarantine", reason="operator.quarantine")
    raw = (c.master.state_dir / "master.log").read_text() + (c.cubelets["a"].state_dir / "cubelet.log").read_text()
    node_token = (c.cubelets["a"].state_dir / "node.token").read_text().strip()
    for secret in (c.master.admin_key, c.master.tenant_key, node_token, r.json().get("access_token") or "-"):
        assert secret not in raw
    cub.verb(device, "recover", "tests", "metrics check done")


def test_a_malformed_request_id_is_replaced_and_every_reply_names_its_id(c: Cluster) -> None:
    r = httpx.get(f"{c.master.url}/v1/health", headers={"X-Request-Id": 'bad id" {x}'})
    assert r.status_code == 200
    got = r.headers["x-request-id"]
    assert got and got != 'bad id" {x}' and got.isalnum()
    r2 = httpx.get(f"{c.master.url}/v1/health")
    assert r2.headers["x-request-id"] not in ("", got)
