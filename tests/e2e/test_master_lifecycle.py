"""CubeMaster lifecycle against real Cubelets: stale nodes, restart reconcile, bad input, idempotency, delete."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from cubeaccel.cli.root import app as cli
from cubeaccel.protocol.errors import CubeError
from tests.support.master_harness import Cluster, example
from tests.support.poll import poll

PROFILES = {"a": "2xh100", "b": "2xh100"}


def node_state(cl: Cluster, name: str) -> str:
    return str(next(n.state for n in cl.c.nodes() if n.node == name))


def test_killed_cubelet_goes_stale_is_not_scheduled_and_its_restart_reconciles(c: Cluster) -> None:
    on_a = c.c.create({"gpu": "H100:2", "id": "keep-a"})
    assert on_a.node == "a"
    orphan = c.cubelets["a"].client  # a reservation CubeMaster never made (a create that died mid-way)
    c.cubelets["a"].sigkill()
    poll(lambda: node_state(c, "a") == "stale")
    placed = [c.c.create({"gpu": "H100:1"}).node for _ in range(2)]
    assert placed == ["b", "b"]  # a's devices are never offered while it is stale
    err = c.refused({"gpu": "H100:1"})
    assert {n: d["reason"] for n, d in err.details["tried"][0]["nodes"].items()} == {
        "a": "node_stale",
        "b": "insufficient_devices",
    }
    assert c.c.capacity().by_state == {"stale": 1, "ready": 1}
    c.cubelets["a"].start()  # same state dir: the Cubelet's journal survives
    poll(lambda: node_state(c, "a") == "ready")
    held = {r["sandbox_id"] for r in orphan.request("GET", "/v1/reservations")["reservations"]}
    # master and Cubelet agree once CubeMaster has heard the restarted node: its reconcile (`lost`) or the
    # heartbeat's word that the node ended the sandbox itself (`failed`), whichever lands first
    agreed = {"running"} if "keep-a" in held else {"lost", "failed"}
    poll(lambda: c.c.sandbox("keep-a").state in agreed, 20, what=f"keep-a's state one of {agreed} ({held})")


def test_restart_reconcile_releases_reservations_master_does_not_know(c: Cluster) -> None:
    cub = c.cubelets["b"].client
    cub.reserve("orphan-1", 1, **{"class": "gpu"})
    assert any(d.sandbox_id == "orphan-1" for d in cub.devices())
    report = c.c.node_verb("b", "reconcile")
    assert report.model_dump()["released_orphans"] == ["orphan-1"]
    poll(lambda: not any(d.sandbox_id == "orphan-1" for d in cub.devices()))


def test_master_record_lost_when_the_cubelet_no_longer_holds_it(c: Cluster) -> None:
    s = c.c.create({"gpu": "H100:1", "id": "gone-1"})
    assert s.node is not None
    c.cubelets[s.node].client.release("gone-1")  # the node lost it behind CubeMaster's back
    report = c.c.node_verb(s.node, "reconcile")
    assert report.model_dump()["lost"] == ["gone-1"]
    got = c.c.sandbox("gone-1")
    assert got.state == "lost" and got.error is not None and got.error.code == "sandbox.lost"
    assert c.c.delete("gone-1").state == "deleted"


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"gpu": "H100:1", "template": "no-such-template"}, 422, "template.unknown"),
        ({"accelerators": [{"class": "gpu", "selector": "device.model =="}]}, 422, "selector.compile_error"),
        ({"accelerators": [{"class": "gpu", "selector": "device.model"}]}, 422, "selector.not_boolean"),
        ({"gpu": "H100:0"}, 422, "request.invalid_count"),
        ({"gpu": "H100:1000000"}, 422, "request.invalid_count"),
        ({"accelerators": [{"class": "gpu", "count": 0}]}, 422, "request.invalid_count"),
        ({"accelerators": [{"class": "gpu", "count": 10**6}]}, 422, "request.invalid_count"),
        ({"accelerators": [{"class": "tpu", "count": 1}]}, 422, "request.unknown_class"),
        ({"gpu": "H100:two"}, 422, "request.invalid_shorthand"),
        ({"gpu": 7}, 422, "request.invalid_shorthand"),
        ({"gpu": "H100:1", "accelerators": [{"class": "gpu"}]}, 422, "request.ambiguous_accelerators"),
        ({}, 422, "request.no_accelerator"),
        ({"gpu": "H100:1", "colour": "red"}, 422, "api.unknown_field"),
        ({"gpu": "H100:1", "id": "bad id!"}, 422, "sandbox.invalid_id"),
        ({"gpu": "H100:1", "memory_mib": 1}, 422, "api.invalid_request"),
        ({"gpu": "accelerator:1", "template": "cuda12-h100"}, 422, "request.class_mismatch"),
    ],
)
def test_bad_input_is_a_4xx_with_a_code_and_creates_nothing(
    c: Cluster, body: dict[str, Any], status: int, code: str
) -> None:
    r = httpx.post(f"{c.master.url}/v1/sandboxes", json=body, headers=c.master.headers())
    assert (r.status_code, r.json()["error"]["code"]) == (status, code), r.text
    assert c.c.sandboxes() == [] or all(s.state == "deleted" or s.state == "lost" for s in c.c.sandboxes())


def test_malformed_json_and_bad_templates_are_refused_with_codes(c: Cluster) -> None:
    r = httpx.post(
        f"{c.master.url}/v1/sandboxes",
        content=b"{nope",
        headers={**c.master.headers(), "content-type": "application/json"},
    )
    assert (r.status_code, r.json()["error"]["code"]) == (422, "api.malformed_json")
    bad = example("cuda12-h100", metadata__name="broken")
    bad["spec"]["cuda"]["version"] = "12.8"  # needs a newer driver than 550.54.15
    r = httpx.post(f"{c.master.url}/v1/templates", json=bad, headers=c.master.headers())
    assert r.status_code == 422 and r.json()["error"]["code"] == "template.invalid"
    assert r.json()["error"]["layer"] == "cuda_runtime"
    r = httpx.post(f"{c.master.url}/v1/templates", json={"apiVersion": "cubeaccel/v1"}, headers=c.master.headers())
    assert r.status_code == 422 and r.json()["error"]["code"].startswith("template.")
    changed = example("cuda12-h100", spec__memory__size_mib=2048)
    r = httpx.post(f"{c.master.url}/v1/templates", json=changed, headers=c.master.headers())
    assert (r.status_code, r.json()["error"]["code"]) == (409, "template.version_exists")
    r = httpx.put(f"{c.master.url}/v1/nodes/x", json={"node": "y"}, auth=c.master.node_auth("x"))
    assert (r.status_code, r.json()["error"]["code"]) == (422, "node.name_mismatch")
    r = httpx.put(
        f"{c.master.url}/v1/nodes/x", json={"node": "x", "cubelet_url": "http://h:1"}, auth=c.master.node_auth("x")
    )
    assert (r.status_code, r.json()["error"]["code"]) == (422, "node.invalid_heartbeat")


def test_templates_are_versioned_and_sandboxes_keep_their_frozen_version(c: Cluster) -> None:
    v2 = example("cuda12-h100", metadata__version="2", spec__memory__size_mib=2048)
    c.c.register_template(v2)
    try:
        s = c.c.create({"gpu": "H100:1"})
        assert s.template is not None and s.template.version == "2"
        pinned = c.c.create({"gpu": "H100:1", "template": "cuda12-h100@1"})
        assert pinned.template is not None and pinned.template.version == "1"
        shown = c.c.request("GET", "/v1/templates/cuda12-h100")
        assert shown["versions"] == ["1", "2"] and shown["default"] is True
    finally:
        c.c.request("DELETE", "/v1/templates/cuda12-h100@2")
    kept = c.c.sandbox(s.id).template
    assert kept is not None and kept.version == "2"  # the copy outlives the template


def test_create_is_idempotent_per_id_and_per_idempotency_key(c: Cluster) -> None:
    r1 = httpx.post(f"{c.master.url}/v1/sandboxes", json={"gpu": "H100:1", "id": "idem-1"}, headers=c.master.headers())
    r2 = httpx.post(f"{c.master.url}/v1/sandboxes", json={"gpu": "H100:1", "id": "idem-1"}, headers=c.master.headers())
    assert (r1.status_code, r2.status_code) == (201, 200)
    assert r1.json()["device_ids"] == r2.json()["device_ids"]
    with pytest.raises(CubeError) as e:
        c.c.create({"gpu": "H100:2", "id": "idem-1"})
    assert (e.value.status, e.value.code) == (409, "sandbox.conflict")
    k1 = c.c.create({"gpu": "H100:1"}, idempotency_key="client-42")
    k2 = c.c.create({"gpu": "H100:1"}, idempotency_key="client-42")
    assert k1.id == k2.id and len(c.c.sandboxes("running")) == 2


def test_a_lifetime_is_extended_then_expires_through_the_release_path(c: Cluster) -> None:
    s = c.c.create({"gpu": "H100:1", "timeout_s": 1.0})
    extended = c.c.set_timeout(s.id, 60)
    assert extended.expires_at is not None and s.expires_at is not None
    assert extended.expires_at > s.expires_at + 50
    time.sleep(1.5)  # past the first deadline: nothing to poll for, the extension must hold
    assert c.c.sandbox(s.id).state == "running"
    c.c.set_timeout(s.id, 0.3)
    poll(lambda: c.c.sandbox(s.id).state == "deleted")
    phases = [p.phase for p in c.c.sandbox(s.id).timeline]
    assert "timeout_set" in phases and phases[-2:] == ["timeout", "deleted"]
    with pytest.raises(CubeError) as e:
        c.c.set_timeout(s.id, 10)
    assert (e.value.status, e.value.code) == (409, "sandbox.not_live")


def test_delete_gives_devices_back_through_the_cubelet_and_timeouts_delete(c: Cluster) -> None:
    s = c.c.create({"gpu": "H100:1", "timeout_s": 0.5})
    poll(lambda: c.c.sandbox(s.id).state == "deleted")
    phases = [p.phase for p in c.c.sandbox(s.id).timeline]
    assert phases[-2:] == ["timeout", "deleted"]
    assert s.node is not None
    cub = c.cubelets[s.node].client
    poll(lambda: all(d.state == "allocatable" for d in cub.devices()))
    s2 = c.c.create({"gpu": "H100:1"})
    gone = c.c.delete(s2.id)
    assert gone.state == "deleted" and c.c.delete(s2.id).state == "deleted"
    with pytest.raises(CubeError) as e:
        c.c.delete("never-was")
    assert (e.value.status, e.value.code) == (404, "sandbox.not_found")


def test_cli_sandbox_create_list_show_delete_and_nodes(c: Cluster) -> None:
    root = cli
    run = CliRunner().invoke
    env = {"CUBEACCEL_MASTER": c.master.url, "CUBEACCEL_API_KEY": c.master.admin_key, "COLUMNS": "200"}
    out = run(root, ["sandbox", "create", "--gpu", "H100:1", "--json", "--id", "cli-1"], env=env)
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["state"] == "running"
    assert "cli-1" in run(root, ["sandbox", "list"], env=env).output
    assert json.loads(run(root, ["sandbox", "show", "cli-1"], env=env).output)["id"] == "cli-1"
    nodes = json.loads(run(root, ["nodes", "--json"], env=env).output)["nodes"]
    assert {n["node"] for n in nodes} >= {"a", "b"}
    bad = run(root, ["sandbox", "create", "--gpu", "H100:0"], env=env)
    assert bad.exit_code == 1 and "request.invalid_count" in bad.output
    assert run(root, ["sandbox", "delete", "cli-1"], env=env).exit_code == 0


def test_cli_sandbox_network_replaces_a_running_sandboxs_egress_narrowing(c: Cluster) -> None:
    tpl = example("cuda12-h100", metadata__name="cli-net", spec__memory__size_mib=1024)
    tpl["spec"]["sandbox"] = {"network": {"mode": "allowlist", "egress": ["192.0.2.0/24:443", "198.51.100.0/24:443"]}}
    c.c.register_template(tpl)
    run = CliRunner().invoke
    env = {"CUBEACCEL_MASTER": c.master.url, "CUBEACCEL_API_KEY": c.master.admin_key, "COLUMNS": "200"}
    s = c.c.create({"template": "cli-net", "id": "cli-net-1"})
    try:
        poll(lambda: c.c.sandbox(s.id).state == "running", 30)
        out = run(cli, ["sandbox", "network", s.id, "--deny-out", "198.51.100.0/24"], env=env)
        assert out.exit_code == 0, out.output
        assert "192.0.2.0/24:443/tcp" in out.output and "198.51.100" not in out.output
        req = c.c.sandbox(s.id).request
        assert req is not None and req.network_policy == {"mode": "allowlist", "egress": ["192.0.2.0/24:443/tcp"]}
        out = run(cli, ["-o", "json", "sandbox", "network", s.id], env=env)  # nothing named: the template's whole
        assert json.loads(out.output)["network_policy"]["egress"] == ["192.0.2.0/24:443/tcp", "198.51.100.0/24:443/tcp"]
        bad = run(cli, ["sandbox", "network", s.id, "--allow-out", "203.0.113.9"], env=env)
        assert bad.exit_code == 1 and "network.policy_widened" in bad.output
    finally:
        c.c.delete(s.id)
