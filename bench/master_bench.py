"""CubeMaster placement decisions per second and p50/p99 decision latency at 1,000, 5,000 and 10,000 nodes x 8
devices, with a CEL selector and the contract check: through the node index (`master/index.py`, what CubeMaster
uses), through the full scan it replaced, and a brute-force baseline (every device of every node evaluated for
every request: CEL per device, check_node per node, no memo), all in the same run. CPU per decision is
`time.process_time`; the aim is CPU per decision at 10k ÷ at 1k <= 1.5.

What is timed: one decision (filters + scores + top candidates) plus applying its claim to the views, the part
of a create that scales with the cluster. Heartbeat churn is simulated: before each decision one node gets a
fresh view (new summary), so its contract verdict and memos are recomputed — more churn than 1,000 nodes
heartbeating every 2 s at 1,000 placements/s. Store and HTTP are not in the loop (the e2e tests cover them).

Reference: Kubernetes DRA scheduler_perf thresholds are 40-80 pods/s at 500 nodes.
Run: `PYTHONPATH=src:. .venv/bin/python bench/master_bench.py [--quick]`. Prints one JSON line and a table.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import yaml
from tests.support.scheduler_oracle import evaluate

from cubeaccel.master.index import NodeIndex
from cubeaccel.master.scheduler import Context, Decision, decide, score
from cubeaccel.master.selector import Selector
from cubeaccel.master.view import NodeView, view_from_heartbeat
from cubeaccel.model.contract import CompatibilityContract, NodeSummary, check_node, freeze, label_mismatch
from cubeaccel.model.node_facts import HOTPLUG_PCIE_ROOT_PORT_ACPI, pinned_image
from cubeaccel.model.request import AcceleratorChoice
from cubeaccel.wire.templates import parse_template

ROOT = Path(__file__).resolve().parents[1]
SELECTOR = "device.architecture == 'hopper' && int(device.memory_gib) >= 80"
MODELS = [  # (model, labels, share of nodes)
    ("H100-SXM5-80GB", {"vendor": "nvidia", "memory_gib": "80", "architecture": "hopper"}, 0.6),
    ("A100-SXM4-80GB", {"vendor": "nvidia", "memory_gib": "80", "architecture": "ampere"}, 0.25),
    ("T4-16GB", {"vendor": "nvidia", "memory_gib": "16", "architecture": "turing"}, 0.15),
]
NOW, STALE = 1_000_000.0, 10.0


def contract() -> CompatibilityContract:
    doc = yaml.safe_load((ROOT / "src/cubeaccel/examples/templates/cuda12-h100.yaml").read_text())
    doc["spec"]["memory"]["size_mib"] = 1024
    return freeze(parse_template(doc))


IMAGE = pinned_image(contract().template).to_json()  # every node holds the guest the template pins


def heartbeat(i: int, rng: random.Random) -> dict[str, Any]:
    r, acc = rng.random(), 0.0
    model, labels = MODELS[-1][0], MODELS[-1][1]
    for m, lbl, share in MODELS:
        acc += share
        if r < acc:
            model, labels = m, lbl
            break
    free = rng.choice([8, 8, 8, 6, 4, 3, 2, 1, 0])
    numa = {"0": min(free, 4), "1": max(0, free - 4)}
    return {
        "node": f"node-{i:05d}",
        "cubelet_url": f"http://10.0.{i // 250}.{i % 250}:7701",
        "version": "0.1.0",
        "sent_at": NOW,
        "pinnable_memory_mib": rng.choice([1 << 20, 1 << 20, 1 << 20, 512]),
        "guest_images": [IMAGE],
        "hotplug": [HOTPLUG_PCIE_ROOT_PORT_ACPI],
        "capacity": {
            "node": f"node-{i:05d}",
            "backends": ["vfio"],
            "total": 8,
            "groups": [
                {
                    "class": "gpu",
                    "labels": {**labels, "model": model, "backend": "vfio"},
                    "total": 8,
                    "by_state": {"allocatable": free, "attached": 8 - free},
                    "allocatable_by_numa": numa,
                }
            ],
        },
    }


def cluster(n: int, seed: int = 7) -> tuple[list[NodeView], list[dict[str, Any]]]:
    rng = random.Random(seed)
    bodies = [heartbeat(i, rng) for i in range(n)]
    views = []
    for i, b in enumerate(bodies):
        state = "draining" if i % 97 == 0 else "ready"
        received = NOW - 60 if i % 89 == 0 else NOW  # about 1% stale
        views.append(view_from_heartbeat(b, received, state))
    return views, bodies


def brute_force(
    nodes: list[NodeView], choice: AcceleratorChoice, c: CompatibilityContract, sel: Selector
) -> tuple[str, str] | None:
    """Every device of every node: CEL per device, check_node per node, count free matches, same score."""
    best: tuple[tuple[float, ...], str, str] | None = None
    for n in nodes:
        if NOW - n.received_at > STALE or n.state != "ready":
            continue
        summary = NodeSummary(
            backends=n.backends,
            devices=[g.attributes for g in n.groups],
            pinnable_memory_mib=n.pinnable_memory_mib,
            guest_images=n.guest_images,
            hotplug=n.hotplug,
            name=n.name,
        )
        if any(v.code != "compat.node_no_matching_device" for v in check_node(c, summary)):
            continue
        for g in n.groups:
            free = 0
            for dev in range(g.total):  # one evaluation per device, as if each were listed separately
                attrs = {**g.attributes, "index": str(dev)}
                if g.accel_class != choice.accel_class or not sel.evaluate(attrs):
                    continue
                if not any(label_mismatch(m, attrs) is None for m in c.template.devices):
                    continue
                free += 1
            free = min(free, n.free(g))
            if free >= choice.count:
                key = tuple(-v for v in score(n, g, choice.count))
                if best is None or (key, n.name) < (best[0], best[1]):
                    best = (key, n.name, g.key)
    return None if best is None else (best[1], best[2])


def run(n_nodes: int, decisions: int, baseline_decisions: int, seed: int = 11) -> dict[str, Any]:
    c = contract()
    sel = Selector(SELECTOR)
    out: dict[str, Any] = {"nodes": n_nodes, "devices": n_nodes * 8, "decisions": decisions}
    for mode in ("index", "scan"):
        out.update({f"{mode}_{k}": v for k, v in placements(n_nodes, decisions, c, sel, mode == "index", seed).items()})
    views, _ = cluster(n_nodes)
    rng = random.Random(seed)
    blat, agree, compared = [], 0, 0
    for k in range(baseline_decisions):
        choice = AcceleratorChoice("gpu", rng.choice(COUNTS), SELECTOR)
        if k < max(1, baseline_decisions // 4):  # the index agrees with the baseline on what to pick
            index = NodeIndex()
            for v in views:
                index.put(v)
            d = decide(views, [(choice, c, sel)], NOW, STALE, index=index)
            picked = (d.candidates[0].node.name, d.candidates[0].group.key) if d.candidates else None
            compared += 1
        t0 = time.perf_counter()
        pick = brute_force(views, choice, c, sel)
        blat.append(time.perf_counter() - t0)
        if k < max(1, baseline_decisions // 4):
            agree += pick == picked
        if pick is not None:
            v = next(x for x in views if x.name == pick[0])
            v.admitted = {**v.admitted, pick[1]: v.admitted.get(pick[1], 0) + choice.count}
    bms = sorted(x * 1000 for x in blat)
    out.update(
        {
            "baseline_decisions": baseline_decisions,
            "baseline_per_s": round(baseline_decisions / sum(blat), 1),
            "baseline_p50_ms": round(statistics.median(bms), 3),
            "agree_with_baseline": f"{agree}/{compared}",
            "cel_evaluations": sel.evaluations,
        }
    )
    out["index_vs_scan"] = round(out["index_placements_per_s"] / out["scan_placements_per_s"], 1)
    return out


COUNTS = [1, 1, 1, 2, 2, 4]


def placements(
    n_nodes: int, decisions: int, c: CompatibilityContract, sel: Selector, use_index: bool, seed: int
) -> dict[str, Any]:
    """Decisions with heartbeat churn and claims applied the way NodeCache applies them (index or plain views)."""
    views, bodies = cluster(n_nodes)
    index = NodeIndex()
    for v in views:
        index.put(v)
    rng = random.Random(seed)
    lat, cpu, rejections, placed = [], [], [], 0
    for _ in range(decisions):
        j = rng.randrange(n_nodes)  # heartbeat churn: a fresh view for one node
        old = views[j]
        fresh = view_from_heartbeat(bodies[j], old.received_at, old.state)
        fresh.admitted = old.admitted
        views[j] = fresh
        if use_index:
            index.put(fresh)
        choice = AcceleratorChoice("gpu", rng.choice(COUNTS), SELECTOR)
        t0, c0 = time.perf_counter(), time.process_time()
        if use_index:
            d = decide(views, [(choice, c, sel)], NOW, STALE, index=index)
        else:  # the linear scan the index replaced (now the tests' oracle)
            out = evaluate(views, Context(choice, c, sel, NOW, STALE))
            d = Decision(choice, c, out.candidates, [out])
        if not d.candidates:  # the cluster is full: time the explained rejection apart, then free everything
            rejections.append(time.perf_counter() - t0)
            for v in views:
                if use_index:
                    index.set_admitted(v.name, {}, 0)
                v.admitted = {}
            continue
        best = d.candidates[0]
        claims = {**best.node.admitted, best.group.key: best.node.admitted.get(best.group.key, 0) + choice.count}
        if use_index:
            index.set_admitted(best.node.name, claims, best.node.admitted_memory_mib)
        else:
            best.node.admitted = claims
        placed += 1
        lat.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    ms = sorted(x * 1000 for x in lat)
    return {
        "placed": placed,
        "placements_per_s": round(placed / sum(lat), 1),
        "cpu_us_per_decision": round(sum(cpu) / len(cpu) * 1e6, 1),
        "p50_ms": round(statistics.median(ms), 3),
        "p99_ms": round(ms[int(len(ms) * 0.99) - 1], 3),
        "rejections": len(rejections),
        "rejection_ms": round(statistics.median(rejections) * 1000, 3) if rejections else None,
    }


def main() -> None:
    quick = "--quick" in sys.argv
    sizes = [(1000, 300 if quick else 2000, 8 if quick else 20), (5000, 200 if quick else 1000, 4 if quick else 8)]
    sizes.append((10000, 200 if quick else 1000, 2 if quick else 4))
    results = [run(n, d, b) for n, d, b in sizes]
    print(
        json.dumps({"bench": "master_placement", "selector": SELECTOR, "template": "cuda12-h100", "results": results})
    )
    cols = [
        "nodes",
        "index_placements_per_s",
        "index_p50_ms",
        "index_p99_ms",
        "index_cpu_us_per_decision",
        "scan_placements_per_s",
        "scan_p99_ms",
        "index_vs_scan",
        "baseline_per_s",
        "agree_with_baseline",
    ]
    print(" | ".join(f"{c:>12}" for c in cols))
    for r in results:
        print(" | ".join(f"{r[c]!s:>12}" for c in cols))
    cpu = {r["nodes"]: r["index_cpu_us_per_decision"] for r in results}
    big = results[-1]
    print(
        f"aim at 10,000 nodes: >= 1000 placements/s ({big['index_placements_per_s']}), p99 < 5 ms "
        f"({big['index_p99_ms']} ms), CPU per decision 10k / 1k <= 1.5 ({cpu[10000] / cpu[1000]:.2f})"
    )


if __name__ == "__main__":
    main()
