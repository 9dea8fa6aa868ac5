"""The front door given two CubeMaster replicas on one PostgreSQL keeps serving creates when one is SIGKILLed
(nodes simulated: src/cubeaccel/fleet; the fleet's ledger judges placements)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import pytest

from cubeaccel.fleet.sim import Fleet
from tests.support.frontdoor_process import FrontDoorProcess
from tests.support.master_harness import MasterProcess, example, wait_nodes_ready

pytestmark = pytest.mark.postgres


def create(fd: FrontDoorProcess, key: str, idem: str) -> httpx.Response:
    return httpx.post(
        f"{fd.url}/sandboxes",
        json={"templateID": "cuda12-h100", "timeout": 300},
        headers={"X-API-Key": key, "Idempotency-Key": idem},
        timeout=60,
    )


def test_the_front_door_with_two_replicas_keeps_serving_creates_when_one_is_killed(
    fresh_db: str, tmp_path: Path
) -> None:
    replicas = [MasterProcess(tmp_path / f"m{i}", fresh_db, 5.0).start() for i in range(2)]
    fleet = Fleet([m.url for m in replicas], replicas[0].admin_key, 8, period_s=0.5)
    fd = FrontDoorProcess(tmp_path / "fd", f"{replicas[0].url},{replicas[1].url}", replicas[0].admin_key)
    try:
        fleet.start()
        wait_nodes_ready(replicas[1].client, set(fleet.names))
        replicas[0].client.register_template(example("cuda12-h100", spec__memory__size_mib=1024), default=True)
        fd.start()
        key = replicas[0].tenant_key
        before = [create(fd, key, f"{fleet.prefix}-a{i}") for i in range(3)]
        assert [r.status_code for r in before] == [201] * 3, [r.text for r in before]

        assert replicas[0].proc is not None
        os.kill(replicas[0].proc.pid, signal.SIGKILL)  # the replica the front door tries first
        replicas[0].proc.wait()

        after = [create(fd, key, f"{fleet.prefix}-b{i}") for i in range(5)]
        assert [r.status_code for r in after] == [201] * 5, [r.text for r in after]
        ids = [r.json()["sandboxID"] for r in before + after]
        assert len(set(ids)) == 8
        assert set(fleet.ledger.placed) >= set(ids) and fleet.ledger.double_placements == 0
        # the same key again, on the surviving replica: the same sandbox
        again = create(fd, key, f"{fleet.prefix}-a0")
        assert again.status_code in (200, 201) and again.json()["sandboxID"] == ids[0]
    finally:
        fd.stop()
        fleet.stop()
        for m in replicas:
            m.stop()
