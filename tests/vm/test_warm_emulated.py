"""Warm sandboxes on real MicroVMs (docs/warm.md): a pool kept by the Cubelet, refused until claimed, claimed
(the guest's RNG reseeded), run as the tenant, released through the full release path (scrub VM included),
refilled; a request of another shape misses, with why."""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

import pytest

from cubeaccel.images.manifest import Manifest
from cubeaccel.protocol.errors import CubeError
from cubeaccel.transport.workload_client import WorkloadClient
from cubeaccel.wire.cubelet_api import Event
from tests.support.cubelet_process import CubeletProcess
from tests.support.poll import poll
from tests.support.vmm_cleanup import kill_started_vmms
from tests.vm.test_cubelet_emulated import edu_contract

pytestmark = [pytest.mark.vm, pytest.mark.timeout(900)]  # three boots under TCG: warm, scrub VM, refill


@pytest.fixture
def node(tmp_path: Path, guest_image: Manifest) -> Any:
    p = CubeletProcess(tmp_path, "-", "--backend", "emulated", "--release-timeout", "20", "--warm-max-starts", "1")
    p.start()
    yield p
    p.stop()
    kill_started_vmms(tmp_path)


def _pool(p: CubeletProcess) -> dict[str, Any]:
    pools = p.client.request("GET", "/v1/warm/pools")["pools"]
    assert len(pools) == 1
    return dict(pools[0])


def _warm_ids(p: CubeletProcess) -> list[str]:
    return [
        r["sandbox_id"] for r in p.client.request("GET", "/v1/reservations")["reservations"] if r["phase"] == "warm"
    ]


def _workload(p: CubeletProcess, sid: str, token: str) -> WorkloadClient:
    sock = str(p.state_dir / "cubelet.sock")
    return WorkloadClient.over(f"http://cubelet/v1/sandboxes/{sid}/workload", token, uds=sock, timeout=60)


def _events(p: CubeletProcess, sid: str, kind: str) -> list[Event]:
    return [e for e in p.client.events(0, 10000).events if e.sandbox_id == sid and e.kind == kind]


def _refused(client: WorkloadClient) -> CubeError:
    with pytest.raises(CubeError) as err:
        client.exec(["/bin/true"], timeout_s=20)
    client.close()
    return err.value


def test_a_warm_sandbox_is_refused_until_claimed_then_runs_the_tenants_command_and_the_pool_refills(
    node: CubeletProcess, guest_image: Manifest
) -> None:
    contract = edu_contract(guest_image)
    shape = {"contract": contract, "template": "edu-demo"}
    node.client.request("PUT", "/v1/warm/pools", {**shape, "size": 1})
    poll(lambda: _pool(node)["warm"] == 1, 300)
    (warm_id,) = _warm_ids(node)
    assert warm_id.startswith("warm-")

    # Before the claim: the Cubelet's proxy refuses every token, and so does the guest on the shim's own socket.
    assert _refused(_workload(node, warm_id, secrets.token_urlsafe(32))).status == 401
    bridge = str(node.state_dir / "shims" / warm_id / "workload.sock")
    assert "access token" in str(_refused(WorkloadClient.over("http://workload", "x" * 43, uds=bridge)))

    # A request of another shape misses, and says why; the pool's own shape claims.
    with pytest.raises(CubeError) as miss:
        node.client.request("POST", "/v1/warm/claim", {**shape, "sandbox_id": "other", "vcpus": 2})
    assert miss.value.code == "warm.no_match" and miss.value.details["reason"] == "warm.no_pool"
    body = node.client.request("POST", "/v1/warm/claim", {**shape, "sandbox_id": "tenant-1", "tenant": "t1"})
    assert body["reservation"]["phase"] == "running" and body["reservation"]["facts"]["shim_id"] == warm_id
    assert body["reservation"]["facts"]["claim_acked"] is True
    # The guest mixed the claim's seed into its kernel RNG, credited and reseeded as root, before the rebind.
    acked = _events(node, "tenant-1", "warm_claim_acked")
    assert [e.details["reseeded"] for e in acked] == [True]

    def reported() -> list[Event]:  # the shim's history report follows its ack
        return [e for e in _events(node, "tenant-1", "shim_report") if e.event == "warm_claimed"]

    poll(lambda: reported(), 30, what="the shim's warm_claimed report")
    claimed = reported()
    assert claimed[0].details["reseed"] == {
        "mixed": True,
        "credited_bits": 256,
        "crng_reseeded": True,
        "why_not": None,
    }
    token = body["access_token"]
    with pytest.raises(CubeError) as empty:  # the refill has not finished a new one yet
        node.client.request("POST", "/v1/warm/claim", {**shape, "sandbox_id": "tenant-2"})
    assert empty.value.details["reason"] == "warm.pool_empty"

    out: list[bytes] = []
    client = _workload(node, "tenant-1", token)
    result = client.exec(["/bin/sh", "-c", "echo hello-tenant"], on_stdout=out.append, timeout_s=60)
    client.close()
    assert result.exit_code == 0 and b"hello-tenant" in b"".join(out)
    assert _refused(_workload(node, "tenant-1", secrets.token_urlsafe(32))).status == 401

    # Delete → the full release path: VMM proven gone, device released, scrubbed by a scrub VM, revalidated
    # (allocatable) → the pool refills with a new warm sandbox.
    dev = body["devices"][0]["id"]
    node.client.release("tenant-1")

    def rows() -> list[dict[str, Any]]:
        return list(node.client.request("GET", "/v1/reservations")["reservations"])

    poll(lambda: all(r["sandbox_id"] != "tenant-1" for r in rows()), 120)  # closed: VMM proven gone
    assert node.vmm(warm_id) is None

    def device_trail() -> list[str]:
        events = [e for e in node.client.events(0, 10000).events if e.device_id == dev]
        return [e.event or e.kind for e in events[[e.sandbox_id for e in events].index("tenant-1") :]]

    try:
        poll(lambda: "revalidated" in device_trail(), 300, what="the device scrubbed and revalidated")
    except AssertionError as e:
        state = next(d for d in node.client.devices() if d.id == dev)
        raise AssertionError(f"{e}: {state.state} ({state.reason}), trail {device_trail()}") from None
    trail = device_trail()
    order = [
        trail.index(k) for k in ("teardown", "release_confirmed", "scrub_started", "scrub_finished", "revalidated")
    ]
    assert order == sorted(order), trail
    scrubbed = [e for e in node.client.events(0, 10000).events if e.device_id == dev and e.kind == "scrub_finished"]
    assert scrubbed[-1].details["ok"] is True
    poll(lambda: _pool(node)["warm"] == 1, 300, what="the pool refilled")
    assert _warm_ids(node) != [warm_id] and _pool(node)["claims"] == 1
