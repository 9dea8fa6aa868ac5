"""A front door killed in the middle of a create leaves no sandbox behind (issue 30 #7).

Real processes: CubeMaster, one simulated Cubelet with one device, and the E2B front door. The node's device is
being released (its reset made slow), so the front door's create waits in CubeMaster for capacity; the front door
is SIGKILLed (by its pid) while it waits; then the device is back and CubeMaster places the create nobody will
answer. The sandbox lives
on its create lease only (the front door renews it until it replies), so it is deleted within the lease, not at
the end of the 600 s the client asked for.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from cubeaccel.host.pci.simulated import SimulatedPciHost
from tests.support.frontdoor_process import FrontDoorProcess
from tests.support.master_harness import Cluster
from tests.support.poll import poll

NODE = "fdk-n1"
LEASE_S = 15.0


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[tuple[Cluster, FrontDoorProcess]]:
    cl = Cluster(tmp_path, {NODE: "1xh100"})
    fd = FrontDoorProcess(tmp_path / "fd", cl.master.url, cl.master.admin_key, "--create-lease", str(LEASE_S))
    fd.start()
    try:
        yield cl, fd
    finally:
        fd.stop()
        cl.stop()


def _create_through(fd: FrontDoorProcess, key: str, outcome: dict[str, Any]) -> None:
    try:
        r = httpx.post(
            f"{fd.url}/sandboxes",
            json={"templateID": "cuda12-h100", "timeout": 600},
            headers={"X-API-Key": key},
            timeout=120,
        )
        outcome["reply"] = r.status_code
    except httpx.HTTPError as e:
        outcome["error"] = type(e).__name__


def test_a_create_whose_front_door_died_is_deleted_within_its_lease(stack: tuple[Cluster, FrontDoorProcess]) -> None:
    cl, fd = stack
    blocker = cl.c.create({"gpu": "H100:1"}).id
    host = SimulatedPciHost(path=cl.cubelets[NODE].state_dir / "simulated-host.json")
    host.set_reset_delay(8.0)
    deleting = threading.Thread(target=cl.c.delete, args=(blocker,), daemon=True)  # answers after the reset
    deleting.start()
    poll(lambda: cl.c.sandbox(blocker).state == "deleting", 30, what="its device is coming back")
    outcome: dict[str, Any] = {}
    client = threading.Thread(target=_create_through, args=(fd, cl.master.tenant_key, outcome), daemon=True)
    client.start()
    waiting = poll(
        lambda: [s for s in cl.c.sandboxes() if s.id != blocker and s.state in ("scheduling", "placing")],
        30,
        what="the create waits for capacity (in CubeMaster, or placed on the node that keeps it the device)",
    )
    orphan = waiting[0].id
    assert fd.proc is not None
    fd.proc.kill()  # SIGKILL, by the pid this test started
    fd.proc.wait(10)
    client.join(30)
    assert "reply" not in outcome, outcome  # no client learned the id
    host.set_reset_delay(0.0)
    deleting.join(60)
    placed = poll(lambda: s if (s := cl.c.sandbox(orphan)).node == NODE else None, 30, what="the orphan placed")
    assert (
        placed.expires_at is not None and placed.expires_at - placed.created_at <= LEASE_S + 1
    )  # its lease, not the 600 s asked for
    t0 = time.monotonic()
    gone = poll(lambda: s if (s := cl.c.sandbox(orphan)).state == "deleted" else None, LEASE_S + 30, what="reaped")
    print(f"orphan deleted {time.monotonic() - t0:.1f}s after it was placed (lease {LEASE_S:g}s)")
    assert [t.phase for t in gone.timeline if t.phase == "timeout"] == ["timeout"]
    poll(lambda: all(n.allocatable == n.total for n in cl.c.nodes()), 30, what="the device is back")
