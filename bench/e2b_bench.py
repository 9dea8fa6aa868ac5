"""The E2B SDK through the front door, side by side with cubeaccel's own CLI path, on real MicroVMs.

1. create → first command returned: the SDK (`Sandbox.create` then `commands.run("true")`, which the SDK runs
   as `/bin/bash -l -c true`) against the CLI (`cubeaccel sandbox create --wait` then `cubeaccel sandbox exec
   SB -- /bin/bash -l -c true`, each a new process, as a user types them). Runs alternate; p50/p99 of N each.
   Each sandbox is deleted and its device back to allocatable before the next (one sandbox at a time).
2. the front door's added latency per envd call: the same unary call (`process.Process/List`) and the same
   command (`Start /bin/true` to its end) through the front door and straight to the node's Cubelet proxy, on one
   sandbox; p50/p99 of M calls each, interleaved.

One CubeMaster, one emulated Cubelet, one front door; prints /proc/loadavg (the machine is shared).
Run: `PYTHONPATH=src:. .venv/bin/python bench/e2b_bench.py [--runs 10] [--calls 50]`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from e2b import Sandbox
from tests.e2b.test_e2b_vm import TEMPLATE, start_stack, stop_stack
from tests.support.poll import poll

from cubeaccel.images.builder import build
from cubeaccel.protocol.envd_process import ListResponse
from cubeaccel.protocol.proto_json import Empty
from cubeaccel.transport.workload_client import WorkloadClient


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(p * (len(s) - 1)))]


def summary(xs: list[float]) -> dict[str, float]:
    return {"p50_ms": round(pct(xs, 0.5) * 1000, 1), "p99_ms": round(pct(xs, 0.99) * 1000, 1), "n": len(xs)}


def wait_released(stack: dict[str, Any], sid: str) -> None:
    poll(lambda: stack["master"].client.sandbox(sid)["state"] == "deleted", 120)
    poll(lambda: all(d.state == "allocatable" for d in stack["cubelet"].client.devices()), 120)


def sdk_once(stack: dict[str, Any], opts: dict[str, Any]) -> float:
    t0 = time.perf_counter()
    sbx = Sandbox.create(TEMPLATE, **opts)
    sbx.commands.run("true")
    took = time.perf_counter() - t0
    sbx.kill()
    wait_released(stack, sbx.sandbox_id)
    return took


def cli_once(stack: dict[str, Any]) -> float:
    env = {**os.environ, "CUBEACCEL_MASTER": stack["master"].url, "CUBEACCEL_API_KEY": stack["master"].admin_key}
    cli = [sys.executable, "-c", "from cubeaccel.cli import main; main()", "sandbox"]
    t0 = time.perf_counter()
    out = subprocess.run([*cli, "create", "--template", TEMPLATE, "--wait", "--json"], env=env, capture_output=True)
    assert out.returncode == 0, (out.stdout + out.stderr).decode(errors="replace")[-2000:]
    s = json.loads(out.stdout)
    env["CUBEACCEL_SANDBOX_TOKEN"] = s["access_token"]
    subprocess.run([*cli, "exec", s["id"], "--", "/bin/bash", "-l", "-c", "true"], env=env, check=True)
    took = time.perf_counter() - t0
    stack["master"].client.delete(s["id"])
    wait_released(stack, s["id"])
    return took


def per_call(stack: dict[str, Any], opts: dict[str, Any], calls: int) -> dict[str, Any]:
    sbx = Sandbox.create(TEMPLATE, **opts)
    token = sbx._envd_access_token or ""
    node_url = next(n["cubelet_url"] for n in stack["master"].client.nodes())
    direct = WorkloadClient.over(f"{node_url}/v1/sandboxes/{sbx.sandbox_id}/workload", token)
    via = WorkloadClient.over(stack["fd"].url, token)
    via.http.headers["E2b-Sandbox-Id"] = sbx.sandbox_id
    out: dict[str, Any] = {}
    try:
        fn: Callable[[WorkloadClient], object]
        for name, fn in (
            ("list", lambda wl: wl.unary("process.Process/List", Empty(), ListResponse.from_json)),
            ("exec_true", lambda wl: wl.exec(["/bin/true"])),
        ):
            times: dict[str, list[float]] = {"front_door": [], "direct": []}
            for _ in range(calls):
                for label, wl in (("front_door", via), ("direct", direct)):
                    t0 = time.perf_counter()
                    fn(wl)
                    times[label].append(time.perf_counter() - t0)
            fd, dr = summary(times["front_door"]), summary(times["direct"])
            added = statistics.median(a - b for a, b in zip(times["front_door"], times["direct"], strict=True))
            out[name] = {"front_door": fd, "direct": dr, "added_median_ms": round(added * 1000, 1)}
    finally:
        sbx.kill()
        wait_released(stack, sbx.sandbox_id)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--calls", type=int, default=50)
    args = ap.parse_args()
    image, _ = build()
    base = Path(tempfile.mkdtemp(prefix="e2b-bench-"))
    stack = start_stack(base, image)
    url = stack["fd"].url
    opts = {"api_key": stack["master"].tenant_key, "api_url": url, "sandbox_url": url, "request_timeout": 600}
    load = [Path("/proc/loadavg").read_text().split()[:3]]
    try:
        sdk, cli = [], []
        for _ in range(args.runs):
            sdk.append(sdk_once(stack, opts))
            cli.append(cli_once(stack))
        result = {
            "create_to_first_run": {"sdk": summary(sdk), "cli": summary(cli)},
            "per_envd_call": per_call(stack, opts, args.calls),
        }
    finally:
        load.append(Path("/proc/loadavg").read_text().split()[:3])
        stop_stack(stack)
    print(json.dumps({**result, "loadavg_before_after": load}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
