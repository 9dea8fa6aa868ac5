"""A CPU-only sandbox through real CubeMaster and Cubelet processes (simulated nodes): placed without a device,
its node's devices untouched and its pinned memory charged, deleted through the ordinary release path."""

from __future__ import annotations

import pytest

from cubeaccel.wire.master_api import NodeSummary
from tests.support.master_harness import Cluster, example
from tests.support.poll import poll

PROFILES = {"gpu": "2xh100", "full": "1xh100"}


@pytest.fixture
def cl(c: Cluster) -> Cluster:
    c.c.register_template(example("base"))
    return c


def node(cl: Cluster, name: str) -> NodeSummary:
    return next(n for n in cl.c.nodes() if n.node == name)


def test_a_cpu_only_sandbox_takes_no_device_and_its_release_completes(cl: Cluster) -> None:
    gpu = cl.c.create({"gpu": "H100:1", "id": "holds-full"})  # packing puts it on `full`: no free device left there
    assert gpu.node == "full"
    before = {n: node(cl, n).allocatable for n in PROFILES}
    s = cl.c.create({"template": "base", "id": "cpu-1"}, wait_s=30)
    assert s.state == "running" and s.device_ids == [] and s.count == 0 and s.accel_class == "none"
    # where it costs devices least: the node with no free device
    assert s.node == "full"
    cub = cl.cubelets["full"].client
    held = cub.reservation("cpu-1")
    assert held.reservation is not None and held.reservation.device_ids == [] and held.devices == []
    poll(lambda: "cpu-1" in (node(cl, "full").pinned_memory.sandboxes or {}), 20, what="the ledger charges it")
    assert {n: node(cl, n).allocatable for n in PROFILES} == before
    cursor = max((e.seq for e in cub.events(limit=10000).events), default=0)
    cl.c.delete("cpu-1")
    poll(lambda: cl.c.sandbox("cpu-1").state == "deleted", 30, what="cpu-1 deleted")
    mine = [e for e in cub.events(since=cursor, limit=10000).events if e.sandbox_id == "cpu-1"]
    kinds = [e.kind for e in mine]
    assert "teardown_started" in kinds and "reservation_closed" in kinds  # the release path ran to its end
    assert not any(e.device_id for e in mine)  # no device reserved, detached, reset or scrubbed for it
    assert {n: node(cl, n).allocatable for n in PROFILES} == before
    cl.c.delete("holds-full")


def test_a_gpu_request_naming_the_cpu_only_template_is_refused_by_class(cl: Cluster) -> None:
    err = cl.refused({"template": "base", "gpu": "H100:1"})
    assert err.code == "request.class_mismatch"
