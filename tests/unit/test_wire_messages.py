"""The versioned wire messages: each round-trips through JSON, and a version this build does not read is refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, get_args

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

from cubeaccel.cubelet.capacity import capacity_summary
from cubeaccel.cubelet.lifecycle import ReservationRequest
from cubeaccel.model.contract import freeze
from cubeaccel.model.template_spec import API_VERSION, KIND
from cubeaccel.protocol.errors import CubeError
from cubeaccel.protocol.reports import ShimReport, ShimReportKind
from cubeaccel.transport.http_reply import reply_body
from cubeaccel.wire import cubelet_api as CW
from cubeaccel.wire import master_api as MW
from cubeaccel.wire.capacity import CapacitySummary
from cubeaccel.wire.heartbeat import Heartbeat
from cubeaccel.wire.reports import ShimReportBody, parse_report, report_json
from cubeaccel.wire.shim_spec import MAX_DEVICES, parse_spec
from cubeaccel.wire.templates import TemplateDocument, load_template, parse_template
from tests.support.cubelet_harness import Node
from tests.support.master_builders import group, heartbeat

EXAMPLES = Path(__file__).resolve().parents[2] / "src" / "cubeaccel" / "examples" / "templates"


def _refuses_version(model: type[BaseModel], body: dict[str, Any]) -> str:
    with pytest.raises(ValidationError) as e:
        model.model_validate({**body, "v": 2})
    (err,) = e.value.errors()
    assert err["type"] == "unsupported_version" and err["loc"] == ("v",)
    return err["msg"]


@given(
    kind=st.sampled_from(list(ShimReportKind)),
    device_ids=st.lists(st.text(max_size=20), max_size=4).map(tuple),
    at=st.floats(allow_nan=False, allow_infinity=False),
    start_id=st.none() | st.text(max_size=64),
)
def test_a_shim_report_round_trips_through_json(
    kind: ShimReportKind, device_ids: tuple[str, ...], at: float, start_id: str | None
) -> None:
    r = ShimReport("sb-1", kind, device_ids, {"pid": 7, "why": ["a"]}, at, start_id)
    line = json.dumps(report_json(r))
    assert json.loads(line)["v"] == 1
    assert parse_report(json.loads(line)) == r


def test_a_shim_report_keeps_todays_leniency_but_not_an_unknown_version() -> None:
    old = {"sandbox_id": "sb-1", "kind": "vm_started", "a_newer_field": 1}  # no v: an older shim's report
    assert parse_report(old) == ShimReport("sb-1", ShimReportKind.VM_STARTED)
    assert _refuses_version(ShimReportBody, old) == "unsupported ShimReportBody version 2: this build reads v1"
    for bad in ({"sandbox_id": "sb", "kind": "exploded"}, {"sandbox_id": "sb", "kind": "vm_started", "at": "nan"}):
        with pytest.raises(ValueError):
            parse_report(bad)


def test_the_capacity_summary_round_trips_and_refuses_an_unknown_version(node: Node) -> None:
    devices = node.cubelet.store.devices()
    summary = capacity_summary(devices, "n1", ["vfio"])
    body = summary.to_json()
    assert body["v"] == 1 and body["groups"][0]["class"] == "gpu" and body["total"] == len(devices)
    assert CapacitySummary.model_validate(json.loads(json.dumps(body))) == summary
    _refuses_version(CapacitySummary, body)


def test_a_heartbeat_round_trips_and_reads_an_older_cubelets_body() -> None:
    body = heartbeat("n1", group("H100-PCIe-80GB", 2), url="http://127.0.0.1:9")
    hb = Heartbeat.model_validate(body)
    assert hb.v == 1  # the builder writes no v, as a Cubelet before versions did
    assert Heartbeat.model_validate(json.loads(json.dumps(hb.to_json()))) == hb
    assert "unsupported Heartbeat version 2" in _refuses_version(Heartbeat, body)


def test_the_template_document_names_its_version_and_round_trips() -> None:
    assert get_args(TemplateDocument.model_fields["apiVersion"].annotation) == (API_VERSION,)
    assert get_args(TemplateDocument.model_fields["kind"].annotation) == (KIND,)
    t = load_template(EXAMPLES / "edu-demo.yaml")
    assert parse_template(json.loads(json.dumps(t.to_json()))) == t
    with pytest.raises(CubeError) as e:
        parse_template({**t.to_json(), "apiVersion": "cubeaccel/v2"})
    assert e.value.code == "template.unsupported_api_version"


def test_a_client_refuses_a_reply_of_a_version_it_cannot_read() -> None:
    request = httpx.Request("GET", "http://cubelet/v1/health")
    assert reply_body(httpx.Response(200, json={"v": 1, "status": "ok"}, request=request))["status"] == "ok"
    assert reply_body(httpx.Response(200, json={"status": "ok"}, request=request)) == {"status": "ok"}
    with pytest.raises(CubeError) as e:
        reply_body(httpx.Response(200, json={"v": 2, "status": "ok"}, request=request))
    assert e.value.code == "api.unsupported_reply_version" and "/v1/health" in e.value.message


REQUESTS: list[BaseModel] = [
    CW.ReservationBody.model_validate(
        {
            "sandbox_id": "sb-1",
            "count": 2,
            "class": "gpu",
            "labels": {"model": "H100"},
            "contract": freeze(load_template(EXAMPLES / "edu-demo.yaml")).to_json(),
        }
    ),
    CW.OperatorBody(who="op", reason="bad fan", restore_driver=True),
    MW.StatusBody.model_validate(
        {"phase": "failed", "error": {"code": "compat.x", "layer": "guest_kernel", "phase": "starting"}}
    ),
    MW.SandboxBody.model_validate({"id": "sb-1", "gpu": "H100:1", "timeout_s": 30.0, "idempotency_key": "k"}),
    MW.OperatorBody(reason="maintenance"),
    MW.DefaultBody(template="cuda12-h100"),
]


@pytest.mark.parametrize("body", REQUESTS, ids=lambda b: type(b).__module__.rsplit(".", 1)[1] + "." + type(b).__name__)
def test_each_request_body_round_trips_and_refuses_another_version(body: BaseModel) -> None:
    sent = json.loads(json.dumps(body.model_dump(mode="json", by_alias=True)))
    assert sent["v"] == 1
    assert type(body).model_validate(sent) == body
    assert "version 2" in _refuses_version(type(body), sent)
    with pytest.raises(ValidationError) as e:
        type(body).model_validate({**sent, "unknown": 1})
    assert e.value.errors()[0]["type"] == "extra_forbidden"


def test_a_simulated_node_starts_a_sandbox_with_more_devices_than_a_real_shims_root_ports(tmp_path: Path) -> None:
    """The 16-device bound is the real shim's machine (its validation context), not part of the message."""
    node = Node.create(tmp_path, "h100x20")
    node.cubelet.reserve("sb-20", ReservationRequest(count=20))
    res = node.cubelet.start("sb-20")
    assert res is not None and res.phase == "running" and len(res.device_ids) == 20 > MAX_DEVICES
    with pytest.raises(CubeError) as e:
        parse_spec({"sandbox_id": "sb", "memory_mib": 64, "devices": [{}] * (MAX_DEVICES + 1)})
    assert e.value.details["field"] == "devices"
