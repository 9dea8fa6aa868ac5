"""How soon capacity coming back is used (issue 37 #4, #9), on a one-GPU simulated node in process:

- `refill_wake`: a warm pool refused for want of a device, the device comes back (its scrub passes): seconds from
  the device turning `allocatable` to the refill's warm reservation. Before, the refused start counted as a
  failure and backed the pool off (2 s, doubling to 300 s), so this was up to the backoff; now the change wakes
  the refill.
- `create_after_kill`: create → kill → create with the scrub of the killed sandbox's device held, a warm pool (of
  another shape) refilling and the node heartbeating every 0.1 s: seconds from the scrub passing to the waiting
  create `running` (it was a 409 `schedule.placement_failed` whenever the refill won the device).

A real Cubelet (journal, lifecycle, warm pools) and a real CubeMaster (SQLite), joined in process as in
tests/unit/test_create_after_kill.py; no VMM. Run: `PYTHONPATH=src:. .venv/bin/python bench/capacity_wait_bench.py
[--runs 5]`. Prints one JSON line and min/median/max per measure, with the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from tests.host.test_cubelet_scrub import PASSED, GatedRunner
from tests.support.contract_builders import example_doc
from tests.support.cubelet_harness import Node
from tests.support.poll import poll
from tests.unit.test_create_after_kill import Beating, Create, InProcess, beat, spec

from cubeaccel.cubelet.lifecycle import ReservationRequest
from cubeaccel.cubelet.store import Event
from cubeaccel.master.service import CubeMaster, MasterConfig
from cubeaccel.master.store import MasterStore
from cubeaccel.model.states import DeviceState


def _node(root: Path) -> tuple[Node, GatedRunner, dict[str, float]]:
    root.mkdir()
    node = Node.create(root, "h100")
    gate = GatedRunner(PASSED)
    node.scrub.runner = gate
    seen: dict[str, float] = {}

    def stamp(events: list[Event]) -> None:
        for e in events:
            if e.kind == "transition" and e.to_state == "allocatable":
                seen.setdefault("allocatable", time.perf_counter())
            if e.kind == "reservation_created" and (e.sandbox_id or "").startswith("warm-"):
                seen.setdefault("warm_reserved", time.perf_counter())

    node.cubelet.store.listeners.append(stamp)
    return node, gate, seen


def refill_wake(root: Path) -> float:
    node, gate, seen = _node(root)
    c = node.cubelet
    c.reserve("tenant", ReservationRequest(count=1))
    c.start("tenant")
    c.warm.set_pool(ReservationRequest(count=1, template="bench"), 1)
    c.warm.start()
    try:
        poll(lambda: c.warm.views()[0].waiting_for is not None, 10)
        c.release("tenant")
        poll(lambda: node.cubelet.store.devices()[0].state is DeviceState.RELEASED, 10)
        gate.gate.set()
        poll(lambda: "warm_reserved" in seen, 30)
        return seen["warm_reserved"] - seen["allocatable"]
    finally:
        c.warm.stop()


def create_after_kill(root: Path) -> float:
    node, gate, _ = _node(root)
    gate.gate.set()
    m = CubeMaster(MasterStore(str(root / "m.db")), MasterConfig(staleness_s=1e9))
    try:
        m.registry.register(example_doc(), default=True)
        cubelet = InProcess(node)
        m.client = lambda url: cubelet  # type: ignore[assignment,method-assign,return-value]
        node.cubelet.warm.set_pool(ReservationRequest(count=1, template="bench"), 1)
        beat(m, node)
        m.create(spec("sb-0"))
        node.cubelet.warm.start()
        gate.gate.clear()
        m.delete("sb-0")
        poll(lambda: node.cubelet.store.devices()[0].state is DeviceState.RELEASED, 10)
        with Beating(m, node):
            create = Create(m, "sb-1")
            create.start()
            poll(lambda: len(node.cubelet.capacity_waits) == 1, 10)
            t0 = time.perf_counter()
            gate.gate.set()
            create.join(30)
            took = time.perf_counter() - t0
        assert create.row is not None and create.row.state == "running", create.error
        return took
    finally:
        node.cubelet.warm.stop()
        m.store.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    out: dict[str, list[float]] = {"refill_wake": [], "create_after_kill": []}
    with tempfile.TemporaryDirectory(prefix="capwait-bench-") as d:
        for i in range(args.runs):
            out["refill_wake"].append(refill_wake(Path(d) / f"r{i}"))
            out["create_after_kill"].append(create_after_kill(Path(d) / f"c{i}"))
    load = os.getloadavg()
    summary = {
        k: {"min_ms": min(v) * 1000, "median_ms": statistics.median(v) * 1000, "max_ms": max(v) * 1000}
        for k, v in out.items()
    }
    print(json.dumps({"runs": args.runs, "load": load, **summary}))
    for k, s in summary.items():
        print(f"{k:18} min {s['min_ms']:8.1f} ms  median {s['median_ms']:8.1f} ms  max {s['max_ms']:8.1f} ms")
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")


if __name__ == "__main__":
    main()
