"""The Cubelet workload proxy's own cost, without a VM, with and without upstream connection reuse, same run.

Path: httpx over TCP → uvicorn serving the real Cubelet app (simulated host, one running sandbox) → its workload
proxy → the shim's real bridge (`workload.sock`, mux framing) → a unix socket standing in for the VMM's port →
the real guest service (`--mux-fd`). Raw = the bridge's `workload.sock` directly. "fresh" sets the proxy's
keep-alive pool to 0 (one new unix connection + mux stream + HTTP connection per call: what it did before
`WorkloadUpstreams`); "pooled" is the default. exec = one `process.Process/Start` of `/bin/true` until its
end-of-stream; files = one upload and one download of a random file. 3 runs each, min/median/max, with
/proc/loadavg before and after (the machine is shared).

Run: `PYTHONPATH=src:. .venv/bin/python bench/workload_proxy_bench.py [--n 200] [--mib 32] [--runs 3]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import uvicorn
from tests.support.cubelet_harness import Node
from tests.support.master_harness import free_port
from tests.unit.test_workload_bridge import FakePort
from workload_measure import measure

from cubeaccel.cubelet import server as cubelet_server
from cubeaccel.cubelet.api.deps import CubeletParts
from cubeaccel.cubelet.api.workload_upstreams import WorkloadUpstreams
from cubeaccel.cubelet.lifecycle import ReservationRequest
from cubeaccel.shim.workload_bridge import WorkloadBridge
from cubeaccel.transport.workload_client import WorkloadClient


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--mib", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="wl-proxy-bench-"))
    (tmp / "node").mkdir()
    node = Node.create(tmp / "node")
    node.cubelet.reserve("sb", ReservationRequest(count=1))
    node.cubelet.start("sb")
    token = node.cubelet.take_token("sb")
    assert token is not None
    node.shim.workload_socket = lambda sandbox_id: tmp / "workload.sock"  # type: ignore[method-assign]
    port = FakePort(tmp / "vmm.sock")
    bridge = WorkloadBridge(tmp / "vmm.sock", tmp / "workload.sock", token)
    bridge.start(10)
    bridge.wait_healthy(30)
    http_port = free_port()
    app = cubelet_server.create_app(node.cubelet)
    config = uvicorn.Config(app, host="127.0.0.1", port=http_port, log_level="error")
    server = uvicorn.Server(config)
    threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    results: dict[str, Any] = {"load_before": Path("/proc/loadavg").read_text().split()[:3], "n": args.n}
    whole = f"http://127.0.0.1:{http_port}/v1/sandboxes/sb/workload"
    keepalive = WorkloadUpstreams.KEEPALIVE
    try:
        for name in ("raw_channel", "proxy_pooled", "proxy_fresh"):
            WorkloadUpstreams.KEEPALIVE = 0 if name == "proxy_fresh" else keepalive
            CubeletParts.of(app).upstreams.drop("sb")  # the next call builds a client with this pool size
            wl = (
                WorkloadClient.over("http://workload", token, uds=str(tmp / "workload.sock"))
                if name == "raw_channel"
                else WorkloadClient.over(whole, token)
            )
            before = bridge.connections
            path = str(tmp / f"bench-{os.getpid()}.bin")
            results[name] = {
                **measure(wl, args.n, args.mib, args.runs, path, os.unlink, warm=5),
                "bridge_connections": bridge.connections - before,
            }
            wl.close()
        results["load_after"] = Path("/proc/loadavg").read_text().split()[:3]
    finally:
        server.should_exit = True
        bridge.close()
        port.stop()
    print(json.dumps(results))
    for name in ("raw_channel", "proxy_pooled", "proxy_fresh"):
        for k, v in results.get(name, {}).items():
            if isinstance(v, dict):
                print(f"{name:<13} {k:<26} min {v['min']:>8} median {v['median']:>8} max {v['max']:>8}")
        print(f"{name:<13} bridge connections opened: {results[name]['bridge_connections']}")
    print("load", results["load_before"], "→", results.get("load_after"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
