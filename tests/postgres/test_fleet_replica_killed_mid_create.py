"""A create whose replica is SIGKILLed while the node is reserving, replayed with the same Idempotency-Key on
the other replica, gives one sandbox: the one the node reserved (nodes simulated: src/cubeaccel/fleet).

The survivor answers once the dead replica's placement counts as abandoned (twice the Cubelet timeout, 60 s):
slow, and docs/master.md says so, but never a second sandbox and never a lost create."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from cubeaccel.fleet.api import Faults
from cubeaccel.fleet.sim import Fleet
from tests.support.master_harness import MasterProcess, example, wait_nodes_ready
from tests.support.poll import poll

pytestmark = pytest.mark.postgres


def test_a_key_replayed_on_the_second_replica_after_the_first_died_mid_create_gives_one_sandbox(
    fresh_db: str, tmp_path: Path
) -> None:
    replicas = [MasterProcess(tmp_path / f"m{i}", fresh_db, 5.0).start() for i in range(2)]
    faults = Faults()
    fleet = Fleet([m.url for m in replicas], replicas[0].admin_key, 4, faults=faults, period_s=0.5)
    try:
        fleet.start()
        wait_nodes_ready(replicas[1].client, set(fleet.names))
        replicas[0].client.register_template(example("cuda12-h100", spec__memory__size_mib=1024), default=True)
        assert fleet.api is not None
        key = f"{fleet.prefix}-once"
        body, headers = {"gpu": "H100:1"}, {**replicas[0].headers(), "Idempotency-Key": key}

        faults.latency_s = 2.0  # the node answers slowly: the first replica dies while it reserves
        first: list[httpx.Response | Exception] = []

        def on_first() -> None:
            try:
                first.append(httpx.post(f"{replicas[0].url}/v1/sandboxes", json=body, headers=headers, timeout=30))
            except httpx.HTTPError as e:
                first.append(e)

        t = threading.Thread(target=on_first)
        t.start()
        poll(lambda: fleet.api is not None and fleet.api.counters.arrived_reserves == 1, 20, what="the reserve sent")
        assert replicas[0].proc is not None
        os.kill(replicas[0].proc.pid, signal.SIGKILL)
        t.join(30)
        assert first and isinstance(first[0], httpx.HTTPError)  # the caller got no answer
        poll(lambda: fleet.ledger.handed_out == 1, 10, what="the node's reservation")
        faults.latency_s = 0.0

        t0 = time.monotonic()
        again = httpx.post(f"{replicas[1].url}/v1/sandboxes", json=body, headers=headers, timeout=120)
        assert again.status_code in (200, 201), again.text
        sid = again.json()["id"]
        assert list(fleet.ledger.placed) == [sid] and fleet.ledger.handed_out == 1
        assert fleet.ledger.double_placements == 0
        poll(lambda: replicas[1].client.sandbox(sid).state == "running", 30, what="the record settled")
        assert time.monotonic() - t0 < 90
        assert [s.id for s in replicas[1].client.sandboxes("running")] == [sid]
    finally:
        fleet.stop()
        for m in replicas:
            m.stop()
