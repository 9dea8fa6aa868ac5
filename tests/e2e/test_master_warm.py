"""CubeMaster's create claims a warm sandbox first (docs/warm.md): a real CubeMaster (SQLite) and a real Cubelet
process on the simulated host, whose pool the Cubelet keeps and advertises in its heartbeat. A matching create
takes the warm path and its timeline says so; a create of another shape takes the cold path with the reason."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from cubeaccel.model.contract import freeze
from cubeaccel.protocol.errors import CubeError
from cubeaccel.wire.master_api import Sandbox, WarmPoolShown
from cubeaccel.wire.templates import parse_template
from tests.support.cubelet_process import CubeletProcess
from tests.support.master_harness import MasterProcess, cubelet, example, wait_nodes_ready
from tests.support.poll import poll

TEMPLATE = example("cuda12-h100", spec__memory__size_mib=1024)


def warm_pool(node: CubeletProcess, size: int, **shape: Any) -> None:
    contract = freeze(parse_template(TEMPLATE)).to_json()
    node.client.request(
        "PUT",
        "/v1/warm/pools",
        {"contract": contract, "template": "cuda12-h100", "class": "gpu", "size": size, **shape},
    )


def advertised(m: MasterProcess, node: str) -> list[WarmPoolShown]:
    n = next((n for n in m.client.nodes() if n.node == node), None)
    return [] if n is None else n.warm_pools


def path_entries(row: Sandbox) -> list[dict[str, Any]]:
    """The create's `path` timeline entries (warm or cold, and why), with their detail fields."""
    return [e.model_dump() for e in row.timeline if e.phase == "path"]


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[tuple[MasterProcess, CubeletProcess]]:
    m = MasterProcess(tmp_path / "master", staleness=5.0).start()
    (tmp_path / "n").mkdir()
    node = cubelet(tmp_path / "n", "4xh100", "n", m.url).start()
    try:
        wait_nodes_ready(m.client, {"n"})
        m.client.register_template(TEMPLATE, default=True)
        yield m, node
    finally:
        node.stop()
        m.stop()


def test_a_matching_create_claims_a_warm_sandbox_and_its_timeline_says_warm(
    stack: tuple[MasterProcess, CubeletProcess],
) -> None:
    m, node = stack
    warm_pool(node, 2)
    poll(lambda: [p.claimable for p in advertised(m, "n")] == [2], 60)
    warm_ids = set(advertised(m, "n")[0].sandboxes)
    # Reconcile leaves the node's own warm sandboxes alone: CubeMaster has no record of them, by design.
    assert m.client.request("POST", "/v1/nodes/n/reconcile")["released_orphans"] == []
    assert set(advertised(m, "n")[0].sandboxes) == warm_ids
    # Where CubeMaster shows sandboxes and nodes, the warm ones are there in state `warm`.
    listed = m.client.request("GET", "/v1/sandboxes", params={"state": "warm"})["sandboxes"]
    assert {r["id"] for r in listed} == warm_ids and {r["state"] for r in listed} == {"warm"}
    board = m.client.request("GET", "/v1/dashboard")
    assert {r["id"] for r in board["sandboxes"] if r["state"] == "warm"} == warm_ids
    assert [p["warm"] for n in board["nodes"] for p in n["warm_pools"]] == [2]
    env = {**os.environ, "CUBEACCEL_API_KEY": m.admin_key, "COLUMNS": "300"}
    cli = [sys.executable, "-m", "cubeaccel"]
    nodes_out = subprocess.run([*cli, "nodes", "--master", m.url], env=env, capture_output=True, text=True, check=True)
    assert "cuda12-h100 2/2 warm" in nodes_out.stdout, nodes_out.stdout
    listing = subprocess.run(
        [*cli, "sandbox", "list", "--master", m.url, "--json"], env=env, capture_output=True, text=True, check=True
    )
    assert {r["id"] for r in json.loads(listing.stdout)["sandboxes"] if r["state"] == "warm"} == warm_ids

    sb = m.client.create({"gpu": "H100:1", "id": "sb-warm"})
    assert sb.state == "running" and sb.access_token
    (path,) = path_entries(sb)
    assert path["path"] == "warm", (path, advertised(m, "n"))
    assert path["warm_id"] in warm_ids and path["node"] == "n"
    assert len(sb.device_ids) == 1
    # Its phases, timed (the simulated shim's hand-off takes no time and has no agent to reseed).
    (reserved,) = [e for e in sb.timeline if e.phase == "reserved"]
    phases = reserved.model_dump()["phases"]
    assert set(phases) == {"master_ms", "claim_ms", "cas_ms", "reseed_ms", "rebind_ms", "claim_other_ms"}
    assert (phases["reseed_ms"], phases["rebind_ms"]) == (None, 0.0)
    assert 0 <= phases["cas_ms"] <= phases["claim_ms"] and phases["master_ms"] >= 0
    # The Cubelet's reservation is the warm one, renamed: its shim keeps the warm id.
    res = node.client.reservation("sb-warm").reservation
    assert res is not None and res.phase == "running" and res.facts.shim_id == path["warm_id"]

    # The pool refills; the claimed id is never advertised again.
    poll(lambda: [p.claimable for p in advertised(m, "n")] == [2], 60)
    assert path["warm_id"] not in advertised(m, "n")[0].sandboxes
    metrics = httpx.get(f"{m.url}/metrics", headers=m.headers()).text
    assert 'cubeaccel_sandbox_create_paths_total{path="warm",reason=""} 1.0' in metrics
    assert 'kind="warm"' in metrics and "cubeaccel_warm_pool_sandboxes" in metrics

    m.client.delete("sb-warm")
    poll(lambda: m.client.sandbox("sb-warm").state == "deleted", 60)


def test_a_create_of_another_shape_takes_the_cold_path_with_the_reason(
    stack: tuple[MasterProcess, CubeletProcess],
) -> None:
    m, node = stack
    warm_pool(node, 1)
    poll(lambda: [p.claimable for p in advertised(m, "n")] == [1], 60)

    sb = m.client.create({"gpu": "H100:1", "id": "sb-cold", "vcpus": 2})  # the pool's sandboxes have 1 vCPU
    assert sb.state == "running"
    (path,) = path_entries(sb)
    assert path == {**path, "path": "cold", "reason": "warm.no_pool"}
    assert [p.claimable for p in advertised(m, "n")] == [1]  # the warm one is still there
    res = node.client.reservation("sb-cold").reservation
    assert res is not None and res.facts.shim_id in (None, "sb-cold")
    metrics = httpx.get(f"{m.url}/metrics", headers=m.headers()).text
    assert 'cubeaccel_sandbox_create_paths_total{path="cold",reason="warm.no_pool"} 1.0' in metrics

    # The warm sandbox's device is not free for a request of another shape: 3 of 4 devices, then refused.
    assert m.client.capacity().warm == {"cuda12-h100": 1}
    for i in range(2):
        assert m.client.create({"gpu": "H100:1", "id": f"sb-cold-{i}", "vcpus": 2}).state == "running"
    poll(lambda: m.client.capacity().allocatable == 0, 30)  # decided on a summary that shows them held
    with pytest.raises(CubeError) as refused:
        m.client.create({"gpu": "H100:1", "id": "sb-cold-3", "vcpus": 2})
    assert refused.value.code == "schedule.unschedulable" and refused.value.details["warm_held"] == {"n": 1}
    assert [p.warm for p in advertised(m, "n")] == [1]


def test_with_every_warm_sandbox_taken_a_matching_create_goes_cold_with_pool_empty(
    stack: tuple[MasterProcess, CubeletProcess],
) -> None:
    m, node = stack
    warm_pool(node, 1)
    poll(lambda: [p.claimable for p in advertised(m, "n")] == [1], 60)
    warm_pool(node, 0)  # no refill: the one warm sandbox is the pool
    first = m.client.create({"gpu": "H100:1", "id": "sb-1"})
    assert path_entries(first)[0]["path"] == "warm"
    poll(lambda: [p.warm for p in advertised(m, "n")] == [0], 30)
    second = m.client.create({"gpu": "H100:1", "id": "sb-2"})
    assert [(e["path"], e.get("reason"), e.get("refilling")) for e in path_entries(second)] == [
        ("cold", "warm.pool_empty", 0)  # size 0: none on the way either
    ]


def test_an_admin_create_naming_a_warm_id_is_refused_and_the_warm_sandbox_is_kept(
    stack: tuple[MasterProcess, CubeletProcess],
) -> None:
    """`warm-*` is the nodes' own namespace: a create naming one is refused before any node is asked, so no
    claim is refused for it and no cleanup releases the node's warm sandbox of that id."""
    m, node = stack
    warm_pool(node, 1)
    poll(lambda: [p.claimable for p in advertised(m, "n")] == [1], 60)
    (wid,) = advertised(m, "n")[0].sandboxes
    with pytest.raises(CubeError) as refused:
        m.client.create({"gpu": "H100:1", "id": wid})
    assert (refused.value.code, refused.value.status) == ("sandbox.reserved_id", 422)
    res = node.client.reservation(wid).reservation
    assert res is not None and res.phase == "warm"
    page = node.client.request("GET", "/v1/events", params={"sandbox_id": wid})
    assert "teardown_started" not in [e["kind"] for e in page["events"]]
    sb = m.client.create({"gpu": "H100:1", "id": "sb-after"})  # still the pool's, and claimable
    assert [(e["path"], e.get("warm_id")) for e in path_entries(sb)] == [("warm", wid)]


def test_a_new_template_version_rebuilds_the_nodes_warm_pool_and_frees_the_old_ones_devices(
    stack: tuple[MasterProcess, CubeletProcess],
) -> None:
    """The pool's key carries the contract digest, so after a new version no create matches the old pool: the
    old pool is dropped, its warm sandboxes released, and the same pool refilled from the new document."""
    m, node = stack
    warm_pool(node, 2)
    poll(lambda: [p.claimable for p in advertised(m, "n")] == [2], 60)
    (old,) = advertised(m, "n")
    v2 = m.client.register_template({**TEMPLATE, "metadata": {**TEMPLATE["metadata"], "version": "2"}})

    poll(lambda: [(p.key != old.key, p.claimable) for p in advertised(m, "n")] == [(True, 2)], 90)
    (new,) = advertised(m, "n")
    assert (new.template, new.size, new.vcpus) == ("cuda12-h100", 2, 1)

    def on_node() -> set[str]:
        return {r["sandbox_id"] for r in node.client.request("GET", "/v1/reservations")["reservations"]}

    poll(lambda: not set(old.sandboxes) & on_node(), 60)  # released, none kept holding a device
    poll(lambda: m.client.capacity().allocatable == 2, 30)  # 4 devices: the new pool's 2 and 2 free
    sb = m.client.create({"gpu": "H100:1", "id": "sb-v2"})
    assert [e["path"] for e in path_entries(sb)] == ["warm"]
    assert sb.template is not None and (sb.template.version, sb.template.digest) == ("2", v2.digest)
