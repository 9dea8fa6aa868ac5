"""CubeMaster's per-replica cost of a fleet's heartbeats, in process, on a PostgreSQL it starts: the store's CPU per
heartbeat (a beat repeating its summary, and one changing it), and a node-cache reload's CPU with nothing changed,
with `--changed` nodes having repeated their summary, and with `--changed` nodes having changed it. No HTTP: these
are the two costs the fleet bench named (docs/benchmarks.md), measured apart from the machine's other load.

Run: `PYTHONPATH=src:. .venv/bin/python bench/master_ingest_bench.py --nodes 10000 --runs 3`. The same script with
`PYTHONPATH` pointing at another tree's `src` measures that tree (it uses only `MasterStore.heartbeat` and
`NodeCache.views`). The last line is one JSON object; times are CPU seconds of this process (min/median/max).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

from tests.support.master_builders import group, heartbeat
from tests.support.pg_cluster import PgCluster

from cubeaccel.master.cache import NodeCache
from cubeaccel.master.store import MasterStore


def body(i: int, sent_at: float, free: int = 8) -> dict[str, Any]:
    url = f"http://127.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}:7"
    b = heartbeat(f"n{i:05d}", group("H100-PCIe-80GB", 8, free=free), url=url)
    b["sent_at"] = sent_at
    return b


def beats_cpu(store: MasterStore, count: int, sent_at: float, free: int = 8) -> float:
    """CPU seconds per heartbeat stored, for `count` nodes beating once."""
    t = time.process_time()
    for i in range(count):
        store.heartbeat(body(i, sent_at, free), time.time(), 10)
    return (time.process_time() - t) / count


def cpu_of(f: Any) -> float:
    t = time.process_time()
    f()
    return time.process_time() - t


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--nodes", type=int, default=10000)
    p.add_argument("--changed", type=int, default=400, help="nodes that beat between two reloads")
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()
    print("load average before:", os.getloadavg(), flush=True)
    pg = PgCluster()
    try:
        store = MasterStore(pg.url)
        now = time.time()
        for i in range(args.nodes):
            store.heartbeat(body(i, 1000.0), now, 10)
        cache = NodeCache(store)
        cache.views(fresh=True)
        beat_same, beat_changed, idle, after_same, after_changed = [], [], [], [], []
        sent = 1000.0
        for run in range(args.runs):
            idle.append(cpu_of(lambda: cache.views(fresh=True)))
            sent += 2
            beat_same.append(beats_cpu(store, args.changed, sent))
            after_same.append(cpu_of(lambda: cache.views(fresh=True)))
            sent += 2
            beat_changed.append(beats_cpu(store, args.changed, sent, 7 - run % 2))
            after_changed.append(cpu_of(lambda: cache.views(fresh=True)))
        store.close()
    finally:
        pg.stop()

    def mmm(xs: list[float], scale: float = 1000.0) -> list[float]:
        return [round(min(xs) * scale, 2), round(statistics.median(xs) * scale, 2), round(max(xs) * scale, 2)]

    out = {
        "nodes": args.nodes,
        "changed": args.changed,
        "runs": args.runs,
        "heartbeat_cpu_ms_summary_repeated": mmm(beat_same),
        "heartbeat_cpu_ms_summary_changed": mmm(beat_changed),
        "reload_cpu_ms_nothing_changed": mmm(idle),
        "reload_cpu_ms_after_repeated_beats": mmm(after_same),
        "reload_cpu_ms_after_changed_beats": mmm(after_changed),
        "load_after": os.getloadavg(),
    }
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
