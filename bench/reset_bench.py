"""Reserve latency while devices are being reset: 16 HTTP clients against a real Cubelet process doing
reserve → release in a loop, with every reset taking `BENCH_RESET_MS` (default 100 ms, a real FLR) beside the
same run with instant resets. A reset runs while its device is `releasing`; it must not stall other requests.

Prints one JSON line per run and a summary: p99 ratio (with resets ÷ without), aim ≤ 1.5.
Run: `.venv/bin/python bench/reset_bench.py` (BENCH_RUNS, BENCH_PER_CLIENT, BENCH_RESET_MS).
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
from pathlib import Path

from store_bench import http_latency


def main() -> None:
    runs = int(os.environ.get("BENCH_RUNS", "3"))
    per_client = int(os.environ.get("BENCH_PER_CLIENT", "20"))
    delay = float(os.environ.get("BENCH_RESET_MS", "100")) / 1000
    ratios, rows = [], []
    for i in range(runs):
        with tempfile.TemporaryDirectory() as d:
            (Path(d) / "plain").mkdir()
            (Path(d) / "slow").mkdir()
            plain = http_latency(Path(d) / "plain", 16, per_client)
            slow = http_latency(Path(d) / "slow", 16, per_client, reset_delay_s=delay)
        ratio = slow["reserve_p99_ms"] / plain["reserve_p99_ms"]
        ratios.append(ratio)
        row = {
            "run": i,
            "loadavg": Path("/proc/loadavg").read_text().split()[:3],
            "p99_ms_no_reset": round(plain["reserve_p99_ms"], 1),
            "p99_ms_reset": round(slow["reserve_p99_ms"], 1),
            "p50_ms_no_reset": round(plain["reserve_p50_ms"], 1),
            "p50_ms_reset": round(slow["reserve_p50_ms"], 1),
            "pairs_per_s_no_reset": round(plain["reserve_release_pairs_per_s"], 1),
            "pairs_per_s_reset": round(slow["reserve_release_pairs_per_s"], 1),
            "errors": plain["errors"] + slow["errors"],
            "p99_ratio": round(ratio, 2),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(
        f"reserve p99 with {delay * 1000:.0f} ms resets ÷ without, {runs} runs: min {min(ratios):.2f} "
        f"median {statistics.median(ratios):.2f} max {max(ratios):.2f} (aim ≤ 1.5)"
    )


if __name__ == "__main__":
    main()
