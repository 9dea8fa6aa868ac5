"""What the NVIDIA guest image costs to build: from nothing, with the compiled modules cached, and reused.

Three cases, each in a fresh cache directory that shares only what the case allows:
- `cold`: nothing shared but the downloaded packages (`--cold-downloads` shares nothing at all: apt lists and
  every package are fetched too); the module compile, rootfs and digests are all done again;
- `modules`: the compiled modules shared (a guest-code or rootfs change): the image is assembled again;
- `reuse`: the same cache asked again: inputs resolved, artifacts re-hashed, nothing built.
The CPU-only image's `reuse` is the baseline (same run). min/median/max over `--runs`, with /proc/loadavg
before each run (the machine is shared). The cold case costs minutes per run on 2 cores.

Run: `PYTHONPATH=src:. .venv/bin/python bench/image_bench.py [--runs 3] [--cases cold,modules,reuse]`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from cubeaccel.images.builder import build, cache_dir
from cubeaccel.images.nvidia import NVIDIA


def _fresh(root: Path, shared: Path, share: tuple[str, ...]) -> Path:
    (root / "images").mkdir(parents=True)
    for sub in share:
        if (shared / sub).exists():
            os.symlink(shared / sub, root / sub)
    return root


def timed_build(cache: Path, gpu: bool) -> float:
    t0 = time.monotonic()
    build(cache, stack=NVIDIA if gpu else None)
    return time.monotonic() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--cases", default="cold,modules,reuse")
    ap.add_argument("--cold-downloads", action="store_true", help="the cold case downloads everything too")
    args = ap.parse_args()
    shared = cache_dir()
    build(shared, stack=NVIDIA)  # the shared cache holds every input a case may share
    build(shared)
    share = {
        "cold": () if args.cold_downloads else ("debs", "debs-nvidia", "apt"),
        "modules": ("debs", "debs-nvidia", "apt", "vendor-modules"),
    }
    results: dict[str, list[float]] = {}
    loads: dict[str, list[str]] = {}
    for case in [c for c in args.cases.split(",") if c]:
        for i in range(args.runs):
            loads.setdefault(case, []).append(Path("/proc/loadavg").read_text().split()[0])
            if case == "reuse":
                results.setdefault("reuse", []).append(timed_build(shared, gpu=True))
                results.setdefault("reuse (CPU image, baseline)", []).append(timed_build(shared, gpu=False))
                continue
            root = Path(tempfile.mkdtemp(prefix=f"image-bench-{case}-{i}-"))
            try:
                results.setdefault(case, []).append(timed_build(_fresh(root / "c", shared, share[case]), gpu=True))
            finally:
                shutil.rmtree(root, ignore_errors=True)
    for name, secs in results.items():
        base = name.split(" ")[0]
        print(
            f"{name:32s} n={len(secs)} min {min(secs):7.1f} s  median {statistics.median(secs):7.1f} s  "
            f"max {max(secs):7.1f} s  load {','.join(loads.get(base, []))}"
        )
    if "reuse" in results:
        ratio = statistics.median(results["reuse"]) / statistics.median(results["reuse (CPU image, baseline)"])
        print(f"reuse: GPU image / CPU image = {ratio:.2f} (median; re-hashing 550 MB vs 180 MB of artifacts)")


if __name__ == "__main__":
    main()
