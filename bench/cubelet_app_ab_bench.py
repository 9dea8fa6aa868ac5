"""Two trees' Cubelet apps side by side, in process and without a socket: what the web stack (routing, dependency
injection, middleware, response checks) costs per request, with the HTTP server and the client taken out.

Each round starts one child process per tree (that tree's `src` on its PYTHONPATH) that builds a Cubelet on a
simulated host (8 devices, its own store), its unix-socket app (`create_app`, no audit), and drives it with
plain ASGI calls: `N` requests of each kind after 50 of warm-up, measured as the process's CPU time per request
(process_time, worker threads included: steadier than wall time on a shared machine). Kinds: `health`
(`GET /v1/health`, on the event loop), `devices` (`GET /v1/devices`, a sync route: one worker-thread hop),
`refused` (`POST /v1/reservations` for 9 of 8 devices: the hot async route, refused by the Cubelet, 409),
`missing` (`GET /v1/reservations/{id}` of none: 404). Trees alternate round by round; each round's ratio
(tree B ÷ tree A) is taken on the same machine at nearly the same moment.
Run: `.venv/bin/python bench/cubelet_app_ab_bench.py TREE_A TREE_B` (ROUNDS, N).
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

KINDS: dict[str, tuple[str, str, bytes, int]] = {  # method, path, body, the status it must answer
    "health": ("GET", "/v1/health", b"", 200),
    "devices": ("GET", "/v1/devices", b"", 200),
    "refused": ("POST", "/v1/reservations", json.dumps({"sandbox_id": "r1", "count": 9}).encode(), 409),
    "missing": ("GET", "/v1/reservations/none", b"", 404),
}


async def call(app: Any, method: str, path: str, body: bytes) -> int:
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"cubelet"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ],
        "client": ("127.0.0.1", 1),
        "server": ("cubelet", 80),
    }
    sent = False
    status = 0

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:
            await asyncio.sleep(3600)
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = int(message["status"])

    await app(scope, receive, send)
    return status


def child(n: int) -> None:
    from cubeaccel.backends.vfio import VfioBackend
    from cubeaccel.cubelet.lifecycle import CubeletConfig
    from cubeaccel.cubelet.runtime import assemble
    from cubeaccel.cubelet.server import create_app
    from cubeaccel.cubelet.shim_driver import SimulatedShimDriver
    from cubeaccel.cubelet.store import Store
    from cubeaccel.host.pci.simulated import SimulatedPciHost

    with tempfile.TemporaryDirectory() as tmp:
        host = SimulatedPciHost("h100x8")
        store = Store(Path(tmp) / "cubelet.db")
        cubelet = assemble(store, VfioBackend(host, allow=("10de:*",)), SimulatedShimDriver(host), CubeletConfig())
        app = create_app(cubelet, local=True)

        async def run() -> dict[str, float]:
            out = {}
            for kind, (method, path, body, status) in KINDS.items():
                for _ in range(50):
                    got = await call(app, method, path, body)
                    assert got == status, f"{kind}: {got}, not {status}"
                t0 = time.process_time()
                for _ in range(n):
                    await call(app, method, path, body)
                out[kind] = 1e6 * (time.process_time() - t0) / n
            return out

        print(json.dumps(asyncio.run(run())))
        store.close()


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        child(int(sys.argv[2]))
        return
    trees = [Path(t).resolve() for t in sys.argv[1:3]]
    if len(trees) != 2:
        raise SystemExit("usage: cubelet_app_ab_bench.py TREE_A TREE_B")
    rounds, n = int(os.environ.get("ROUNDS", "5")), int(os.environ.get("N", "500"))
    print("load before", Path("/proc/loadavg").read_text().split()[:3])
    res: dict[tuple[str, int], list[float]] = {}
    for _ in range(rounds):
        for k, tree in enumerate(trees):
            env = {**os.environ, "PYTHONPATH": str(tree / "src")}
            argv = [sys.executable, __file__, "--child", str(n)]
            out = json.loads(subprocess.run(argv, env=env, check=True, capture_output=True, text=True).stdout)
            for kind, us in out.items():
                res.setdefault((kind, k), []).append(us)
    print(f"µs per request (N={n}); min / median / max over {rounds} rounds; B/A per round")
    for kind in KINDS:
        a, b = res[(kind, 0)], res[(kind, 1)]
        r = sorted(y / x for x, y in zip(a, b, strict=True))
        print(
            f"{kind:8s} A {min(a):7.1f}/{statistics.median(a):7.1f}/{max(a):7.1f}"
            f"  B {min(b):7.1f}/{statistics.median(b):7.1f}/{max(b):7.1f}"
            f"  B/A {r[0]:.2f}/{statistics.median(r):.2f}/{r[-1]:.2f}"
        )
    print("load after", Path("/proc/loadavg").read_text().split()[:3])


if __name__ == "__main__":
    main()
