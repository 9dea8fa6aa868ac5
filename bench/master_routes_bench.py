"""What CubeMaster's web stack costs per request, in process: `GET /v1/health` (public) and `GET /v1/whoami`
(an admin key checked) through `create_app`'s ASGI app, no socket, one client at a time.

Measures the routing, the access check, the injected dependencies and the reply, so that a change to how routes
are assembled (closures, routers, `Depends`) shows as CPU per request. Prints min/median/max over BENCH_RUNS
runs of BENCH_REQUESTS requests per route, and the load average before and after.
Run: `.venv/bin/python bench/master_routes_bench.py`; to compare with another tree's code, run it with
`PYTHONPATH=OTHER/src` in front.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

import httpx

import cubeaccel
from cubeaccel.master.auth import ADMIN
from cubeaccel.master.server import create_app
from cubeaccel.master.service import CubeMaster, MasterConfig
from cubeaccel.master.store import MasterStore

RUNS = int(os.environ.get("BENCH_RUNS", "5"))
REQUESTS = int(os.environ.get("BENCH_REQUESTS", "2000"))


def spread(xs: list[float]) -> str:
    return f"min {xs[0]:7.1f} median {statistics.median(xs):7.1f} max {xs[-1]:7.1f}"


async def one_run(client: httpx.AsyncClient, path: str, headers: dict[str, str]) -> tuple[float, float]:
    """(wall µs, process CPU µs) per request."""
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(REQUESTS):
        r = await client.get(path, headers=headers)
        assert r.status_code == 200, r.text
    return (time.perf_counter() - t0) / REQUESTS * 1e6, (time.process_time() - c0) / REQUESTS * 1e6


async def bench(tmp: Path) -> None:
    store = MasterStore(str(tmp / "master.db"))
    try:
        master = CubeMaster(store, MasterConfig())
        _, key = master.auth.create_key(ADMIN)
        app = create_app(master)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://master") as client:
            for path, headers in (("/v1/health", {}), ("/v1/whoami", {"authorization": f"Bearer {key}"})):
                await one_run(client, path, headers)  # warm-up: imports, caches, the first schema
                runs = [await one_run(client, path, headers) for _ in range(RUNS)]
                cpu = sorted(c for _, c in runs)
                wall = sorted(w for w, _ in runs)
                print(f"{path:12} cpu µs/request {spread(cpu)} | wall {spread(wall)}")
    finally:
        store.close()


def main() -> None:
    print(f"code: {Path(cubeaccel.__file__).parent}; {RUNS} runs x {REQUESTS} requests per route")
    print(f"load before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(bench(Path(tmp)))
    print(f"load after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
