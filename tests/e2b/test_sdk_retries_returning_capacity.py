"""The E2B SDK (2.63, the pinned one) retries a create answered 503 with `Should-Retry: true` and gets its sandbox
once capacity comes back within its request timeout (nodes simulated: src/cubeaccel/fleet, no VM).

One node with one GPU: the GPU's sandbox is deleted, and the node takes longer to give the GPU back (scrub,
reset) than CubeMaster waits for returning capacity (20 s), so the first create is refused
`schedule.capacity_returning` → 503, Should-Retry: true; the SDK's own retry then finds the GPU back."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
from e2b import Sandbox

from cubeaccel.fleet.api import Faults
from cubeaccel.fleet.sim import Fleet
from tests.support.frontdoor_process import FrontDoorProcess
from tests.support.master_harness import MasterProcess, example, wait_nodes_ready
from tests.support.poll import poll

RELEASE_S = 23.0  # above CubeMaster's capacity wait (20 s), far inside the SDK's 60 s request timeout


def test_the_sdk_retries_a_503_should_retry_and_succeeds_when_capacity_returns(tmp_path: Path) -> None:
    master = MasterProcess(tmp_path / "m", None, 5.0).start()
    faults = Faults()
    fleet = Fleet([master.url], master.admin_key, 1, devices_per_node=1, faults=faults, period_s=0.5)
    fd = FrontDoorProcess(tmp_path / "fd", master.url, master.admin_key)
    try:
        fleet.start()
        wait_nodes_ready(master.client, set(fleet.names))
        master.client.register_template(example("cuda12-h100", spec__memory__size_mib=1024), default=True)
        fd.start()
        key, url = master.tenant_key, fd.url
        first = Sandbox.create("cuda12-h100", api_key=key, api_url=url, sandbox_url=url, request_timeout=60)

        faults.release_s = RELEASE_S
        killer = threading.Thread(target=first.kill)  # blocks until the node gives the GPU back
        killer.start()
        poll(lambda: master.client.sandbox(first.sandbox_id).state == "deleting", 20, what="the GPU returning")

        t0 = time.monotonic()
        # the SDK's own client, with its retry policy (3 retries of a Should-Retry answer)
        second = Sandbox.create("cuda12-h100", api_key=key, api_url=url, sandbox_url=url, request_timeout=60)
        took = time.monotonic() - t0
        killer.join(60)
        assert second.sandbox_id != first.sandbox_id
        assert master.client.sandbox(second.sandbox_id).state == "running"
        assert fleet.ledger.placed == {second.sandbox_id: fleet.names[0]} and fleet.ledger.double_placements == 0
        assert 20 < took < 60, took  # refused once at CubeMaster's wait, then placed on the SDK's retry
        # what the SDK was answered first: CubeMaster's refusal for returning capacity, which it retried
        metrics = httpx.get(f"{master.url}/metrics", headers=master.headers(), timeout=30).text
        assert 'reason="schedule.capacity_returning"' in metrics
    finally:
        fd.stop()
        fleet.stop()
        master.stop()
