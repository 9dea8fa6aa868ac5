"""How long a running sandbox's egress change takes to load: `netpolicy.apply` (one `nft -f` that replaces the
namespace's whole ruleset) for allowlists of 1, 16 and 64 rules, in a real namespace (root, ip, nft; no VM).

Prints one JSON line per size with min/median/max over BENCH_RUNS (default 10) loads, and the load average.
Run: `sudo .venv/bin/python bench/network_update_bench.py`.
"""

from __future__ import annotations

import ipaddress
import json
import os
import statistics
import subprocess
import time
import uuid

from cubeaccel.host.net import netpolicy
from cubeaccel.model.sandbox_policy import EgressRule, NetworkPolicy


def policy(n: int) -> NetworkPolicy:
    base = int(ipaddress.IPv4Address("198.18.0.0"))
    rules = (EgressRule(ipaddress.IPv4Network((base + 256 * i, 24)), 443) for i in range(n))
    return NetworkPolicy("allowlist", tuple(sorted(rules)))


def main() -> None:
    runs = int(os.environ.get("BENCH_RUNS", "10"))
    uplink, sid = f"cbb-{uuid.uuid4().hex[:8]}", f"bench-{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", uplink], check=True)
    try:
        netpolicy.setup(sid, policy(1), node="bench", uplink_netns=uplink)
        node = frozenset(netpolicy.node_addresses(uplink))
        for n in (1, 16, 64):
            times = []
            for i in range(runs):
                p = policy(n if i % 2 == 0 else max(1, n - 1))  # a change each time, as an update is
                t0 = time.perf_counter()
                netpolicy.apply(sid, p, node)
                times.append((time.perf_counter() - t0) * 1000)
            print(
                json.dumps(
                    {
                        "rules": n,
                        "runs": runs,
                        "apply_ms": {
                            "min": round(min(times), 2),
                            "median": round(statistics.median(times), 2),
                            "max": round(max(times), 2),
                        },
                        "load": [round(x, 2) for x in os.getloadavg()],
                    }
                )
            )
    finally:
        netpolicy.teardown(sid, node="bench", uplink_netns=uplink)
        subprocess.run(["ip", "netns", "del", uplink], check=False)


if __name__ == "__main__":
    main()
