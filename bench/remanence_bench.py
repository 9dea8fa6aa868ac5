"""The remanence canary run at full length, and what the scrub of device memory costs (issue 27 #3).

A real emulated Cubelet (QEMU under TCG here) with one memory stand-in (ivshmem-plain over the device's own file,
kept across sandboxes): N tenants in sequence (default 50), each scanning all of the device's memory for earlier
tenants' canaries and then filling it with its own; between tenants the release path's `bar-memory` scrub.
Pass: 0 hits over all tenants. `--scrub-policy none` runs the same with no scrub (every tenant after the first
should find all of its predecessor's canaries: the check bites).

Rates, per scrub, of the same memory:
- memset: the host writing zeros over the device's file through mmap (ctypes.memset), best of 5;
- in guest: the scrub VM's zeroing step (`zero_ms`: the agent writing zeros through the BAR mapping) and zero +
  full read-back (`zero_ms + verify_ms`);
- whole scrub: bytes / (scrub_started → scrub_finished), the scrub VM's boot and teardown included;
each as a ratio to memset, and the scrub's share of a release (scrub duration ÷ release → allocatable).

Run: `PYTHONPATH=src:. .venv/bin/python bench/remanence_bench.py [--tenants 50] [--size 1048576]
[--scrub-policy trusted-vm|none]`.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.support import remanence
from tests.support.cubelet_process import CubeletProcess
from tests.support.vmm_cleanup import kill_started_vmms
from tests.vm.conftest import private_image

from cubeaccel.images.builder import cache_dir


def memset_rate(path: Path) -> float:
    """Bytes/s of zeroing the file's memory in place, host side (the page cache pages the VMM shares)."""
    fd = os.open(path, os.O_RDWR)
    try:
        size = os.fstat(fd).st_size
        buf = mmap.mmap(fd, size)
        try:
            addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
            best = float("inf")
            for _ in range(5):
                t0 = time.perf_counter()
                ctypes.memset(addr, 0, size)
                best = min(best, time.perf_counter() - t0)
            return size / best
        finally:
            del addr
            buf.close()
    finally:
        os.close(fd)


def summary(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)} if values else {}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tenants", type=int, default=50)
    ap.add_argument("--size", type=int, default=1 << 20)
    ap.add_argument("--scrub-policy", choices=("trusted-vm", "none"), default="trusted-vm")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="remanence-bench-"))
    # This tree's image in a cache of the run's own: a newer build from another tree must not become the tenants'
    # guest (their canary script lives in this tree's agent).
    private_image(cache_dir(), tmp / "cache")
    os.environ["CUBEACCEL_CACHE_DIR"] = str(tmp / "cache")
    p = CubeletProcess(
        tmp,
        "-",
        "--backend",
        "emulated",
        "--emulated-devices",
        "0",
        "--memory-device",
        str(args.size),
        "--scrub",
        f"accelerator={args.scrub_policy}",
    )
    p.start()
    try:
        t0 = time.monotonic()
        tenancies = remanence.run(p, args.tenants, "bench")
        wall = time.monotonic() - t0
        (mem,) = remanence.memory_files(p.state_dir)
        memset = memset_rate(mem)
    finally:
        p.stop()
        kill_started_vmms(tmp)
        shutil.rmtree(tmp, ignore_errors=True)
    scrubs = [t.scrub for t in tenancies if t.scrub]
    hits = [t.found["hits"] for t in tenancies]
    zero = [s["bytes_zeroed"] / (s["zero_ms"] / 1000) for s in scrubs if s.get("zero_ms")]
    zero_verify = [s["bytes_zeroed"] / ((s["zero_ms"] + s["verify_ms"]) / 1000) for s in scrubs if s.get("zero_ms")]
    whole = [s["bytes_zeroed"] / s["duration_s"] for s in scrubs if s.get("duration_s")]
    share = [t.scrub["duration_s"] / t.release_s for t in tenancies if t.scrub.get("duration_s") and t.release_s]
    out: dict[str, Any] = {
        "tenants": args.tenants,
        "size": args.size,
        "scrub_policy": args.scrub_policy,
        "tenants_with_hits": sum(1 for h in hits if h),
        "hits_total": sum(hits),
        "scrubs_ok": sum(1 for s in scrubs if s.get("ok")),
        "wall_s": round(wall, 1),
        "memset_bytes_per_s": memset,
        "guest_zero_bytes_per_s": summary(zero),
        "guest_zero_and_readback_bytes_per_s": summary(zero_verify),
        "whole_scrub_bytes_per_s": summary(whole),
        "ratio_guest_zero_to_memset": summary([z / memset for z in zero]),
        "ratio_guest_zero_and_readback_to_memset": summary([z / memset for z in zero_verify]),
        "ratio_whole_scrub_to_memset": summary([w / memset for w in whole]),
        "scrub_share_of_release": summary(share),
        "release_s": summary([t.release_s for t in tenancies]),
        "loadavg": Path("/proc/loadavg").read_text().split()[:3],
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
