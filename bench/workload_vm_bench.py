"""Workloads in a real MicroVM: exec round trip and file MiB/s through the whole path, side by side with the same
operation on the raw channel in the same run.

Whole path = TCP to Cubelet's proxy → the shim's `workload.sock` → mux over virtio-serial → the guest's
cube-workload. Raw channel = the shim's `workload.sock` directly (the bridge and the virtio-serial port, no
proxy). exec = one `process.Process/Start` of `/bin/true` until its end-of-stream (p50/p99 of N per run);
files = one upload (octet-stream) and one download of a random file. 3 runs each, min/median/max, with
/proc/loadavg (the machine is shared). One CubeMaster, one emulated Cubelet, one sandbox.

Run: `PYTHONPATH=src:. .venv/bin/python bench/workload_vm_bench.py [--n 30] [--mib 16]`.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.support.cubelet_process import CubeletProcess
from tests.support.master_harness import MasterProcess, free_port
from tests.support.poll import poll
from tests.support.vmm_cleanup import kill_started_vmms
from tests.vm.test_master_ready import edu_template
from workload_measure import measure

from cubeaccel.images.builder import build
from cubeaccel.transport.workload_client import WorkloadClient


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=30)
    ap.add_argument("--mib", type=int, default=16)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    build()
    base = Path(tempfile.mkdtemp(prefix="wl-bench-"))
    master = MasterProcess(base / "master").start()
    (base / "cubelet").mkdir()
    port = free_port()
    cubelet = CubeletProcess(
        base / "cubelet", "-", "--backend", "emulated", "--master", master.url, "--listen", f"127.0.0.1:{port}",
        "--node", "bench", "--node-token-file", str(master.enrol("bench", base / "cubelet")),
    )  # fmt: skip
    cubelet.start()
    results: dict[str, Any] = {"load_before": Path("/proc/loadavg").read_text().split()[:3]}
    try:
        poll(lambda: any(n.node == "bench" and n.state == "ready" for n in master.client.nodes()), 30)
        master.client.register_template(edu_template(build()[0], "edu-bench"))
        t0 = time.monotonic()
        sb = master.client.create({"template": "edu-bench", "accelerators": [{"class": "accelerator"}]}, wait_s=240)
        results["create_wait_s"] = round(time.monotonic() - t0, 1)
        sid, token = sb.id, sb.access_token
        assert sb.state == "running" and token is not None, sb
        sock = base / "cubelet" / "shims" / sid / "workload.sock"
        paths = {
            "whole_path": WorkloadClient.over(f"http://127.0.0.1:{port}/v1/sandboxes/{sid}/workload", token),
            "raw_channel": WorkloadClient.over("http://workload", token, uds=str(sock)),
        }
        for name, wl in paths.items():
            guest_file = f"/tmp/bench-{os.getpid()}.bin"
            remove = lambda p, w=wl: w.exec(["/bin/rm", "-f", p])  # noqa: E731 - the guest's file
            results[name] = measure(wl, args.n, args.mib, args.runs, guest_file, remove, warm=3)  # warm: bash caches
            wl.close()
        results["load_after"] = Path("/proc/loadavg").read_text().split()[:3]
        master.client.delete(sid)
        poll(lambda: master.client.sandbox(sid).state == "deleted", 90)
    finally:
        cubelet.stop()
        master.stop()
        kill_started_vmms(base)
    print(json.dumps(results))
    for name in ("whole_path", "raw_channel"):
        for k, v in results.get(name, {}).items():
            print(f"{name:<12} {k:<26} min {v['min']:>8} median {v['median']:>8} max {v['max']:>8}")
    print("load", results["load_before"], "→", results.get("load_after"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
