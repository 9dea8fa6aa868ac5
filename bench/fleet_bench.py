"""End-to-end placements through CubeMaster's HTTP API: R replicas on one PostgreSQL (started here), N simulated
nodes x 8 GPUs heartbeating at the production period (src/cubeaccel/fleet), many concurrent clients creating
E2B-shaped sandboxes (`{"gpu": "H100:1"}` with an Idempotency-Key) and deleting their oldest to keep the fleet
about half full, for S seconds; optionally one replica SIGKILLed at T.

What it reports: placements/s (201s per second of load), p50/p99 of a create as its client saw it (retries on
another replica included), heartbeat ingest/s and the CPU CubeMaster and PostgreSQL spend on heartbeats alone
(a window before the load), CPU per placement per process, per-second rates around a replica's death and the
time back to 80 % of the rate before it, double placements counted from the fleet's own ledger (never from
CubeMaster's rows), and lost creates (a create whose key found neither a sandbox nor a refusal after retries).

Everything runs on this machine: the fleet and the clients share the bench process, and the numbers include
what they take from CubeMaster. The load average is printed before and after; a busy machine depresses them.
Run: `PYTHONPATH=src:. .venv/bin/python bench/fleet_bench.py --nodes 1000 --replicas 2 --seconds 10
[--kill-replica-at 5] [--runs 3]`. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from tests.support.frontdoor_process import FrontDoorProcess
from tests.support.master_harness import MasterProcess, example
from tests.support.pg_cluster import PgCluster

from cubeaccel.fleet.sim import Fleet

TICK_S = os.sysconf("SC_CLK_TCK")


def cpu_s(pids: list[int], reaped: bool = False) -> float:
    """User + system CPU seconds of these processes (all their threads) so far; `reaped`: the first one's
    exited children too (PostgreSQL's backends come and go under the postmaster)."""
    total = 0
    for n, pid in enumerate(pids):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
            if reaped and n == 0:
                total += int(fields[13]) + int(fields[14])
        except (OSError, IndexError, ValueError):
            continue
    return total / TICK_S


class FleetProcess:
    """The simulated fleet in a process of its own (`--fleet-process`): its API, its heartbeat senders and the
    bench's clients then hold different GILs, so at 10,000 nodes the simulator's own Python does not slow the
    answers CubeMaster waits for. The parent asks it for its names and reports over a pipe."""

    def __init__(self, masters: list[str], admin_key: str, nodes: int, period_s: float) -> None:
        ctx = multiprocessing.get_context("fork")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_fleet_main, args=(child, masters, admin_key, nodes, period_s), daemon=True)
        self.proc.start()
        self.names: list[str] = self.conn.recv()

    def report(self) -> dict[str, Any]:
        self.conn.send("report")
        out: dict[str, Any] = self.conn.recv()
        return out

    def stop(self) -> None:
        self.conn.send("stop")
        self.proc.join(30)


def _fleet_main(conn: Any, masters: list[str], admin_key: str, nodes: int, period_s: float) -> None:
    fleet = Fleet(masters, admin_key, nodes, period_s=period_s).start()
    conn.send(fleet.names)
    while (cmd := conn.recv()) != "stop":
        if cmd == "report":
            conn.send(fleet.report())
    fleet.stop()


def pg_cpu(pg: PgCluster) -> float:
    return cpu_s(pg.pids(), reaped=True)


@dataclass
class Load:
    replicas: list[MasterProcess]
    keep: int
    end: float
    front_door: FrontDoorProcess | None = None  # E2B-shaped creates through it instead of CubeMaster's API
    dead: set[int] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)
    done: list[tuple[float, float]] = field(default_factory=list)  # (finished at, seconds) of each placement
    refused: Counter[str] = field(default_factory=Counter)
    lost: int = 0
    retried: int = 0
    deletes: int = 0
    delete_errors: int = 0


def refusal_code(reply: dict[str, Any]) -> str:
    """CubeMaster's error code, or the front door's E2B refusal as `status: message` (E2B's shape has no code)."""
    err = reply.get("error")
    if isinstance(err, dict):
        return str(err.get("code"))
    return f"{reply.get('code')}: {str(reply.get('message', ''))[:60]}"


def client(load: Load, k: int) -> None:
    if load.front_door is not None:
        headers = {"X-API-Key": load.replicas[0].tenant_key}
        https = [httpx.Client(base_url=load.front_door.url, headers=headers, timeout=60.0)]
        create_path, body, id_key = "/sandboxes", {"templateID": "cuda12-h100", "timeout": 3600}, "sandboxID"
    else:
        https = [httpx.Client(base_url=m.url, headers=load.replicas[0].headers(), timeout=60.0) for m in load.replicas]
        create_path, body, id_key = "/v1/sandboxes", {"gpu": "H100:1"}, "id"
    delete_prefix = "/sandboxes/" if load.front_door is not None else "/v1/sandboxes/"
    mine: list[tuple[int, str]] = []
    try:
        while time.time() < load.end:
            key = uuid.uuid4().hex
            t0 = time.perf_counter()
            outcome: tuple[int, str] | None = None
            for attempt in range(len(https) * 3):
                i = (k + attempt) % len(https)
                if i in load.dead and load.front_door is None:
                    continue
                try:
                    r = https[i].post(create_path, json=body, headers={"Idempotency-Key": key})
                except httpx.HTTPError:
                    with load.lock:
                        load.retried += 1
                    continue
                reply = r.json()
                ok = r.status_code in (200, 201)
                outcome = (i, reply[id_key]) if ok else (-1, refusal_code(reply))
                break
            with load.lock:
                if outcome is None:
                    load.lost += 1
                elif outcome[0] < 0:
                    load.refused[outcome[1]] += 1
                else:
                    load.done.append((time.time(), time.perf_counter() - t0))
                    mine.append(outcome)
            if outcome is None or outcome[0] < 0:
                continue
            if len(mine) > load.keep:
                _, sid = mine.pop(0)
                for attempt in range(len(https)):
                    i = (k + attempt) % len(https)
                    if i in load.dead and load.front_door is None:
                        continue
                    try:
                        https[i].delete(f"{delete_prefix}{sid}")
                        with load.lock:
                            load.deletes += 1
                        break
                    except httpx.HTTPError:
                        continue
                else:
                    with load.lock:
                        load.delete_errors += 1
    finally:
        for h in https:
            h.close()


def wait_ready(m: MasterProcess, fleet: Fleet | FleetProcess, deadline_s: float) -> tuple[float, float]:
    """Seconds until every node is ready, or (at the deadline, when CubeMaster cannot take every node's
    heartbeat within the staleness bound) until every node has heartbeated once; and the share ready then."""
    t0 = time.time()
    names = set(fleet.names)
    share = 0.0
    while time.time() - t0 < deadline_s:
        try:
            nodes = httpx.get(f"{m.url}/v1/nodes", headers=m.headers(), timeout=120).json()["nodes"]
            known = [n for n in nodes if n["node"] in names]
            share = sum(1 for n in known if n["state"] == "ready") / len(names)
            if share == 1.0 or (len(known) == len(names) and time.time() - t0 > deadline_s / 4):
                return time.time() - t0, share
        except (httpx.HTTPError, KeyError, ValueError):
            pass
        time.sleep(2.0)
    return time.time() - t0, share


def run_once(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    pg = PgCluster()
    replicas: list[MasterProcess] = []
    fleet: Fleet | FleetProcess | None = None
    fd: FrontDoorProcess | None = None
    try:
        for i in range(args.replicas):
            extra = ("--tick", "1.0", "--log-level", args.log_level)
            replicas.append(MasterProcess(root / f"m{i}", pg.url, 10.0, *extra).start())
        t = time.time()
        urls = [m.url for m in replicas]
        if args.fleet_process:
            fleet = FleetProcess(urls, replicas[0].admin_key, args.nodes, args.period)
        else:
            fleet = Fleet(urls, replicas[0].admin_key, args.nodes, period_s=args.period).start()
        enrol_s = time.time() - t
        ready_s, ready_share = wait_ready(replicas[0], fleet, args.ready_deadline)
        replicas[0].client.register_template(example("cuda12-h100", spec__memory__size_mib=1024), default=True)
        master_pids = [m.proc.pid for m in replicas if m.proc is not None]
        if args.front_door:
            fd = FrontDoorProcess(root / "fd", ",".join(m.url for m in replicas), replicas[0].admin_key).start()

        # Heartbeats alone: what ingesting them costs CubeMaster and PostgreSQL.
        beats0, c_m, c_pg, t0 = fleet.report()["heartbeats_sent"], cpu_s(master_pids), pg_cpu(pg), time.time()
        time.sleep(args.heartbeat_window)
        hb_wall = time.time() - t0
        hb = {
            "heartbeats_per_s": round((fleet.report()["heartbeats_sent"] - beats0) / hb_wall, 1),
            "heartbeats_expected_per_s": round(args.nodes / args.period, 1),
            "heartbeat_master_cores": round((cpu_s(master_pids) - c_m) / hb_wall, 3),
            "heartbeat_postgres_cores": round((pg_cpu(pg) - c_pg) / hb_wall, 3),
        }

        keep = max(2, int(args.nodes * 8 * args.fill / args.clients))
        start = time.time()
        load = Load(replicas, keep, start + args.seconds, fd)
        fd_pids = [fd.proc.pid] if fd is not None and fd.proc is not None else []
        c_m, c_pg, c_me, c_fd = cpu_s(master_pids), pg_cpu(pg), time.process_time(), cpu_s(fd_pids)
        threads = [threading.Thread(target=client, args=(load, k), daemon=True) for k in range(args.clients)]
        for th in threads:
            th.start()
        killed_at = None
        if args.kill_replica_at is not None:
            time.sleep(max(0.0, start + args.kill_replica_at - time.time()))
            victim = replicas[-1]
            assert victim.proc is not None
            os.kill(victim.proc.pid, signal.SIGKILL)
            killed_at = time.time()
            load.dead.add(len(replicas) - 1)
        for th in threads:
            th.join(timeout=args.seconds + 120)
        wall = time.time() - start
        placements = len(load.done)
        lat = sorted(d for _, d in load.done)
        per_s = Counter(int(at - start) for at, _ in load.done)
        rates = [per_s.get(s, 0) for s in range(int(args.seconds))]
        out: dict[str, Any] = {
            "nodes": args.nodes,
            "replicas": args.replicas,
            "clients": args.clients,
            "seconds": args.seconds,
            "enrol_s": round(enrol_s, 1),
            "ready_s": round(ready_s, 1),
            "ready_share_at_start": round(ready_share, 3),
            "placements": placements,
            # completed within the load's window; creates still waiting when it closed finish later (late)
            "placements_per_s": round(sum(rates) / args.seconds, 1),
            "late_placements": placements - sum(rates),
            "wall_s": round(wall, 1),
            "p50_ms": round(1000 * lat[len(lat) // 2], 1) if lat else None,
            "p99_ms": round(1000 * lat[int(len(lat) * 0.99)], 1) if lat else None,
            "refused": dict(load.refused),
            "retried_on_another_replica": load.retried,
            "deletes": load.deletes,
            "master_cpu_ms_per_placement": round(1000 * (cpu_s(master_pids) - c_m) / max(1, placements), 2),
            "postgres_cpu_ms_per_placement": round(1000 * (pg_cpu(pg) - c_pg) / max(1, placements), 2),
            "bench_cpu_ms_per_placement": round(1000 * (time.process_time() - c_me) / max(1, placements), 2),
            "front_door_cpu_ms_per_placement": round(1000 * (cpu_s(fd_pids) - c_fd) / max(1, placements), 2)
            if fd is not None
            else None,
            "via": "front door" if fd is not None else "CubeMaster API",
            "fleet_process": bool(args.fleet_process),
            "rates_per_s": rates,
            **hb,
        }
        if killed_at is not None:
            k = int(killed_at - start)
            before = statistics.mean(rates[max(0, k - 5) : k]) if k > 0 else 0.0
            back = next((s - k for s in range(k + 1, len(rates)) if rates[s] >= 0.8 * before), None)
            out.update(killed_at_s=round(killed_at - start, 1), rate_before_kill=before, recovery_s=back)
        time.sleep(1.0)  # deletes in flight reach the fleet
        fleet_report = fleet.report()
        out.update(
            double_placements=fleet_report["double_placements"],
            lost_creates=load.lost,
            heartbeats_failed=fleet_report["heartbeats_failed"],
            heartbeats_late=fleet_report["heartbeats_late"],
        )
        return out
    finally:
        if fd is not None:
            fd.stop()
        if fleet is not None:
            fleet.stop()
        for m in replicas:
            m.stop()
        pg.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=1000)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--kill-replica-at", type=float, default=None)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--period", type=float, default=2.0, help="heartbeat period (the Cubelet's tick)")
    p.add_argument("--heartbeat-window", type=float, default=10.0)
    p.add_argument("--fill", type=float, default=0.5, help="share of the fleet's devices the clients keep held")
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--ready-deadline", type=float, default=240.0)
    p.add_argument("--log-level", default="warning", help="CubeMaster's log level (info logs every request)")
    p.add_argument("--front-door", action="store_true", help="E2B creates through `api serve` (both replicas)")
    p.add_argument("--fleet-process", action="store_true", help="run the simulated fleet in its own process")
    args = p.parse_args()
    print(f"load average before: {os.getloadavg()} on {os.cpu_count()} CPUs", flush=True)
    results = []
    for r in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="fleet-bench-") as tmp:
            res = run_once(args, Path(tmp))
        print(f"run {r + 1}: {json.dumps(res)}", flush=True)
        results.append(res)
    print(f"load average after: {os.getloadavg()}", flush=True)
    summary = dict(results[-1])
    for key in ("placements_per_s", "p50_ms", "p99_ms", "heartbeats_per_s", "master_cpu_ms_per_placement"):
        vals = [x[key] for x in results if x.get(key) is not None]
        if vals:
            summary[f"{key}_min_median_max"] = [min(vals), statistics.median(vals), max(vals)]
    summary["placements_per_s"] = statistics.median(x["placements_per_s"] for x in results)
    summary["double_placements"] = sum(x["double_placements"] for x in results)
    summary["lost_creates"] = sum(x["lost_creates"] for x in results)
    summary["runs"] = args.runs
    summary["load_average_after"] = os.getloadavg()
    summary.pop("rates_per_s", None)
    print(json.dumps(summary))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
