"""CubeMaster's node API refuses bad input with stable codes: heartbeats, Cubelet URLs, operator verbs."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import event, given
from hypothesis import strategies as st

from cubeaccel.master.server import create_app
from cubeaccel.master.service import CubeMaster, MasterConfig
from cubeaccel.master.store import MasterStore
from cubeaccel.master.view import cubelet_url
from cubeaccel.protocol.errors import CubeError
from tests.support.master_builders import EXAMPLE_IMAGES, Credentials, group, heartbeat, image, sandbox_row
from tests.support.stored_rows import stored_state

URL = "http://127.0.0.1:9"  # nothing listens there


@pytest.fixture
def master(tmp_path: Path) -> Iterator[CubeMaster]:
    m = CubeMaster(MasterStore(str(tmp_path / "m.db")), MasterConfig(staleness_s=10.0))
    yield m
    m.store.close()


@pytest.fixture
def api(master: CubeMaster) -> TestClient:
    c = TestClient(create_app(master), raise_server_exceptions=False)
    c.auth = Credentials(master)
    return c


def hb(**changes: Any) -> dict[str, Any]:
    return {**heartbeat("n1", group("H100-PCIe-80GB", 2), url=URL), **changes}


def put_raw(api: TestClient, body: str) -> tuple[int, str]:
    r = api.put("/v1/nodes/n1", content=body.encode(), headers={"content-type": "application/json"})
    return r.status_code, r.json()["error"]["code"] if r.status_code >= 400 else ""


def test_a_valid_heartbeat_registers_the_node(api: TestClient) -> None:
    assert api.put("/v1/nodes/n1", json=hb()).json() == {"v": 1, "node": "n1", "state": "ready"}


@pytest.mark.parametrize("field", ["sent_at", "pinnable_memory_mib"])
@pytest.mark.parametrize("value", ['"nan"', "NaN", "Infinity", "-Infinity", "1e400", "true", '"5"'])
def test_numeric_heartbeat_fields_must_be_finite_numbers(api: TestClient, field: str, value: str) -> None:
    body = hb()
    body.pop(field, None)
    raw = json.dumps(body)[:-1] + f', "{field}": {value}}}'
    # not JSON numbers at all: the edge refuses them before the heartbeat model sees the body
    code = "api.non_finite_number" if value in ("NaN", "Infinity", "-Infinity", "1e400") else "node.invalid_heartbeat"
    assert put_raw(api, raw) == (422, code)
    assert api.get("/v1/nodes").json()["nodes"] == []  # nothing written


@pytest.mark.parametrize(
    "facts",
    [
        {"guest_images": "sha256:" + "1" * 64},
        {"guest_images": [{"digest": "sha256:short"}]},
        {"guest_images": [image(kernel_release="../etc")]},
        {"guest_images": [image(kernel_digests=[])]},
        {"guest_images": [image(modules_img_digest=None)]},
        {"guest_images": [image()] * 257},
        {"hotplug": "pcie-root-port-acpi"},
        {"hotplug": ["Bad Path"]},
    ],
)
def test_node_facts_are_validated_before_anything_is_written(api: TestClient, facts: dict[str, Any]) -> None:
    r = api.put("/v1/nodes/n1", json=hb(**facts))
    assert (r.status_code, r.json()["error"]["code"]) == (422, "node.invalid_heartbeat")
    assert api.get("/v1/nodes").json()["nodes"] == []


def test_the_node_list_shows_the_guests_and_hot_plug_paths_a_node_reported(api: TestClient) -> None:
    api.put("/v1/nodes/n1", json=hb()).raise_for_status()
    (node,) = api.get("/v1/nodes").json()["nodes"]
    assert node["hotplug"] == ["pcie-root-port-acpi"]
    assert [i["kernel_release"] for i in node["guest_images"]] == [i["kernel_release"] for i in EXAMPLE_IMAGES]
    assert {i["digest"] for i in node["guest_images"]} == {i["digest"] for i in EXAMPLE_IMAGES}


@pytest.mark.parametrize("where", ["total", "allocatable", "numa"])
def test_group_counts_must_be_finite_whole_numbers(api: TestClient, where: str) -> None:
    g = group("H100-PCIe-80GB", 2)
    if where == "total":
        g["total"] = 1.5
    elif where == "allocatable":
        g["by_state"]["allocatable"] = -1
    else:
        g["allocatable_by_numa"] = {"0": 1e300}
    r = api.put("/v1/nodes/n1", json=heartbeat("n1", g, url=URL))
    assert (r.status_code, r.json()["error"]["code"]) == (422, "node.invalid_heartbeat")


@pytest.mark.parametrize(
    "url",
    [
        "file:///etc/passwd",
        "http://host",
        "ftp://h:21",
        "http://h:1/path",
        "http://u:p@h:1",
        "http://h:1?q=1",
        "http://h:99999",
        "http://h:0",
        "http://@h:1",
        "",
        7,
        None,
    ],
)
def test_cubelet_url_must_be_http_host_port(api: TestClient, url: Any) -> None:
    r = api.put("/v1/nodes/n1", json=hb(cubelet_url=url))
    assert (r.status_code, r.json()["error"]["code"]) == (422, "node.invalid_url")


# Each part of a URL, the spellings the parser must accept and those it must refuse.
URL_PARTS: dict[str, tuple[st.SearchStrategy[str], st.SearchStrategy[str]]] = {
    "scheme": (st.sampled_from(["http", "https", "HTTP", "Https"]), st.sampled_from(["ftp", "file", "", "htp"])),
    "userinfo": (st.just(""), st.sampled_from(["u@", "u:p@", ":p@", "@"])),
    "host": (st.sampled_from(["127.0.0.1", "node-1", "gpu17.example.org", "[::1]", "[fe80::1]"]), st.just("")),
    "port": (st.integers(1, 65535).map(str), st.sampled_from([":", ":0", ":65536", ":99999", ":x", ":-1", ""])),
    "path": (st.sampled_from(["", "/"]), st.sampled_from(["/v1", "//", "/x/", "/v1?"])),
    "query": (st.sampled_from(["", "?"]), st.sampled_from(["?a=1", "?a"])),
    "fragment": (st.sampled_from(["", "#"]), st.sampled_from(["#f", "#/"])),
}


@st.composite
def url_like(draw: st.DrawFn) -> tuple[str, str | None]:
    """A URL built from parts with at most one part wrong, and what the parser must make of it: the normalised
    `scheme://host:port`, or None when it must refuse. About half are valid; every way to be wrong is drawn."""
    wrong = draw(st.one_of(st.none(), st.sampled_from(sorted(URL_PARTS))))
    p = {name: draw(bad if name == wrong else good) for name, (good, bad) in URL_PARTS.items()}
    port = p["port"] if wrong == "port" else f":{p['port']}"
    netloc = f"{p['userinfo']}{p['host']}{port}"
    raw = f"{p['scheme']}://{netloc}{p['path']}{p['query']}{p['fragment']}"
    return raw, None if wrong else f"{p['scheme'].lower()}://{netloc}"


@given(url_like())
def test_cubelet_url_parser_accepts_exactly_http_host_port_and_returns_it_normalised(
    case: tuple[str, str | None],
) -> None:
    raw, expected = case
    event("accepted" if expected is not None else "refused")
    try:
        url = cubelet_url(raw)
    except CubeError as e:
        assert (e.code, e.status) == ("node.invalid_url", 422)
        assert expected is None, f"{raw!r} refused"
        return
    assert url == expected and cubelet_url(url) == url


@given(st.text(max_size=40))
def test_cubelet_url_parser_refuses_arbitrary_text_with_its_code(raw: str) -> None:
    """Text that is not URL-shaped (nearly all of it here) is refused with the code, never an exception."""
    try:
        url = cubelet_url(raw)
    except CubeError as e:
        assert (e.code, e.status) == ("node.invalid_url", 422)
        return
    assert url.startswith(("http://", "https://")) and cubelet_url(url) == url


def test_a_live_node_keeps_its_url_until_it_goes_stale(api: TestClient, master: CubeMaster) -> None:
    assert api.put("/v1/nodes/n1", json=hb()).status_code == 200
    r = api.put("/v1/nodes/n1", json=hb(cubelet_url="http://10.0.0.66:7701"))
    assert (r.status_code, r.json()["error"]["code"]) == (409, "node.url_conflict")
    assert api.get("/v1/nodes/n1").json()["cubelet_url"] == URL
    # stale (no heartbeat for longer than --staleness): a restarted Cubelet may come back elsewhere
    master.store.heartbeat(hb(), 1000.0, master.config.staleness_s)
    master.cache.invalidate()
    assert api.put("/v1/nodes/n1", json=hb(cubelet_url="http://10.0.0.66:7701")).status_code == 200
    assert api.get("/v1/nodes/n1").json()["cubelet_url"] == "http://10.0.0.66:7701"


def test_reconcile_with_the_cubelet_down_is_a_502(api: TestClient) -> None:
    api.put("/v1/nodes/n1", json=hb())
    r = api.post("/v1/nodes/n1/reconcile")
    assert (r.status_code, r.json()["error"]["code"]) == (502, "cubelet.unreachable")


def test_operator_verbs_refuse_an_empty_reason_but_need_none(api: TestClient) -> None:
    api.put("/v1/nodes/n1", json=hb())
    r = api.post("/v1/nodes/n1/drain", json={"who": "alice", "reason": ""})
    assert r.status_code == 422 and r.json()["error"]["code"] == "api.invalid_request"
    assert api.post("/v1/nodes/n1/drain", json={"who": "alice", "reason": "swap"}).json()["state"] == "draining"
    assert api.post("/v1/nodes/n1/undrain", json={"who": "alice"}).json()["state"] == "ready"


def _starting(master: CubeMaster, sid: str = "sb-push", node: str = "n1") -> None:
    now = 1000.0
    assert (
        master.store.insert_sandbox(sandbox_row(sid, now, state="starting", device_ids=["d1"], expires_at=None)) is None
    )
    master.store.update_sandbox(sid, None, node=node)


@pytest.mark.parametrize(
    "body",
    [
        {"phase": "ready"},  # not a phase
        {"phase": "failed"},  # a failure without its error
        {"phase": "running", "error": {"code": "x", "layer": "cubelet"}},  # running with an error
        {"phase": "failed", "error": {"code": "", "layer": "cubelet"}},
        {"phase": "failed", "error": {"code": "x", "layer": "cubelet", "extra": 1}},
        {"phase": "failed", "error": {"code": "x" * 201, "layer": "cubelet"}},
        {"phase": "failed", "error": {"code": "x", "layer": "cubelet"}, "workload": {"state": "answering", "since": 1}},
        {"phase": "running", "workload": {"state": "frozen", "since": 1.0}},  # not a condition
        {"phase": "running", "workload": {"state": "unresponsive"}},  # no since
    ],
)
def test_a_malformed_status_push_is_refused_and_changes_nothing(
    api: TestClient, master: CubeMaster, body: dict[str, Any]
) -> None:
    _starting(master)
    r = api.put("/v1/nodes/n1/sandboxes/sb-push/status", json=body)
    assert r.status_code == 422 and r.json()["error"]["layer"] == "api"
    assert stored_state(master.store, "sb-push") == "starting"


def test_a_status_push_counts_only_from_the_sandboxes_own_node(api: TestClient, master: CubeMaster) -> None:
    _starting(master)
    failed: dict[str, Any] = {
        "phase": "failed",
        "error": {"code": "compat.modules_img_module_failed", "layer": "modules_img"},
    }
    r = api.put("/v1/nodes/n2/sandboxes/sb-push/status", json=failed)
    assert (r.status_code, r.json()["error"]["code"]) == (409, "sandbox.not_on_node")
    assert api.put("/v1/nodes/n1/sandboxes/sb-nope/status", json=failed).status_code == 404
    assert stored_state(master.store, "sb-push") == "starting"
    assert api.put("/v1/nodes/n1/sandboxes/sb-push/status", json=failed).json() == {"v": 1, "state": "failed"}
    row = master.store.sandbox("sb-push")
    assert (
        row is not None
        and row.error is not None
        and row.error.model_dump() == {**failed["error"], "message": "", "phase": None, "node": "n1"}
    )
    # a late "running" never revives a failed sandbox
    assert api.put("/v1/nodes/n1/sandboxes/sb-push/status", json={"phase": "running"}).json() == {
        "v": 1,
        "state": "failed",
    }


def test_a_workload_push_changes_no_state_and_shows_only_on_a_live_sandbox(api: TestClient, master: CubeMaster) -> None:
    _starting(master)
    stalled = {
        "phase": "running",
        "workload": {"state": "unresponsive", "reason": "workload.unresponsive", "since": 7.0},
    }
    for _ in range(2):  # a repeated push (the same stall, the same since) is one entry
        assert api.put("/v1/nodes/n1/sandboxes/sb-push/status", json=stalled).json() == {"v": 1, "state": "starting"}
    shown = api.get("/v1/sandboxes/sb-push").json()
    assert shown["workload"] == {
        "state": "unresponsive",
        "reason": "workload.unresponsive",
        "since": 7.0,
        "message": None,
    }
    failed = {"phase": "failed", "error": {"code": "vmm.exited", "layer": "backend"}}
    api.put("/v1/nodes/n1/sandboxes/sb-push/status", json=failed)
    assert api.get("/v1/sandboxes/sb-push").json()["workload"] is None  # history only once it ended
    back = {"phase": "running", "workload": {"state": "answering", "since": 9.0}}
    assert api.put("/v1/nodes/n1/sandboxes/sb-push/status", json=back).json() == {"v": 1, "state": "failed"}
    phases = [t["phase"] for t in api.get("/v1/sandboxes/sb-push").json()["timeline"]]
    assert phases.count("workload_unresponsive") == 1 and "workload_recovered" not in phases  # not live: not kept


def test_a_heartbeat_of_an_unknown_version_is_refused_and_one_without_a_version_is_v1(api: TestClient) -> None:
    r = api.put("/v1/nodes/n1", json=hb(v=2))
    assert (r.status_code, r.json()["error"]["code"]) == (422, "node.invalid_heartbeat")
    assert "unsupported Heartbeat version 2" in r.json()["error"]["message"]
    assert api.get("/v1/nodes").json()["nodes"] == []
    assert api.put("/v1/nodes/n1", json=hb(v=1)).status_code == 200
