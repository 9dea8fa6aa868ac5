"""CubeMaster create → `running`, warm (a claimed warm sandbox) vs cold (the same request with the pool set to
another vCPU count), in the same run: a real CubeMaster (SQLite) and a real Cubelet process on the simulated host
(in-process shim: no VMM, no guest), so what is timed is the control plane of each path — CubeMaster's
decision, its store writes, the Cubelet's reserve/start or journal CAS and hand-off. The warm ÷ cold ratio here
says how much control-plane time the claim saves, not the issue's VM figures (bench/e2b_bench.py measures
those on emulated devices).

Run: `PYTHONPATH=src:. .venv/bin/python bench/master_warm_bench.py [--runs 5]`. Prints one JSON line and a table with
min/median/max per path and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.e2e.test_master_warm import TEMPLATE, advertised, path_entries, warm_pool
from tests.support.master_harness import MasterProcess, cubelet, wait_nodes_ready
from tests.support.poll import poll

from cubeaccel.transport.master_client import MasterClient


def _timed_create(client: MasterClient, sid: str, body: dict[str, Any]) -> tuple[float, str]:
    t0 = time.perf_counter()
    row = client.create({"gpu": "H100:1", "id": sid, **body})
    ms = (time.perf_counter() - t0) * 1000
    assert row.state == "running", row
    return ms, str(path_entries(row)[-1]["path"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="warm-bench-") as d:
        root = Path(d)
        m = MasterProcess(root / "m", staleness=5.0).start()
        (root / "n").mkdir()
        node = cubelet(root / "n", "8xh100", "n", m.url).start()
        times: dict[str, list[float]] = {"warm": [], "cold": []}
        try:
            wait_nodes_ready(m.client, {"n"})
            m.client.register_template(TEMPLATE, default=True)
            warm_pool(node, 1)
            for i in range(args.runs):
                poll(lambda: [p.claimable for p in advertised(m, "n")] == [1], 60)
                ms, path = _timed_create(m.client, f"w-{i}", {})
                assert path == "warm"
                times["warm"].append(ms)
                ms, path = _timed_create(m.client, f"c-{i}", {"vcpus": 2})  # no pool of 2 vCPUs: cold
                assert path == "cold"
                times["cold"].append(ms)
                for sid in (f"w-{i}", f"c-{i}"):
                    m.client.delete(sid)
                poll(lambda: all(s.state == "deleted" for s in m.client.sandboxes()), 60)
        finally:
            node.stop()
            m.stop()
    out: dict[str, Any] = {
        p: {"min": min(v), "median": statistics.median(v), "max": max(v), "n": len(v)} for p, v in times.items()
    }
    out["ratio_median"] = {"warm/cold": out["warm"]["median"] / out["cold"]["median"]}
    out["loadavg"] = list(os.getloadavg())
    print(json.dumps(out))
    for p in ("warm", "cold"):
        s = out[p]
        print(f"{p:5} create→running ms: min {s['min']:.1f}  median {s['median']:.1f}  max {s['max']:.1f}")
    print(f"warm/cold (median) {out['ratio_median']['warm/cold']:.2f}   load {out['loadavg']}")


if __name__ == "__main__":
    main()
