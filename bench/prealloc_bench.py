"""Where prealloc + lock spends its time, against a memset of the same size, same run.

`bench/shim_bench.py` timed QEMU from spawn until VmLck covered guest RAM and compared that with a memset:
1.7-3x per GiB. That figure folds in QEMU's own start. Here each variant is timed the same way and the same
QEMU with 64 MiB of RAM (its start, nothing to fault) is subtracted, so what is left is the memory work:

- `memset`: an anonymous mmap written with memset (page faults + zeroing + the write), the baseline;
- `mlock`: the same mmap locked with mlock(2) (the kernel faults and zeroes every page, no user write);
- `qemu prealloc`: `prealloc=on` alone (QEMU touches one byte per page, unlocked);
- `qemu lock`: `-overcommit mem-lock=on` alone (mlockall(MCL_FUTURE): the kernel populates the mapping);
- `qemu prealloc+lock`: both, what the shim runs today;
- `qemu prealloc+lock threads=N`: both, with `prealloc-threads`.

Run: `.venv/bin/python bench/prealloc_bench.py [--gib 1,2] [--runs 3]`. Prints one JSON line and a table.
Needs RLIMIT_MEMLOCK >= the largest size (root here).

`--threads 1,2,4 --gib 1,4,8` (issue 26): only memset and what the shim now runs (prealloc + lock with
`prealloc-threads=N`), as throughput: prealloc+lock GiB/s ÷ memset GiB/s in the same run (above 1: faster than
a memset). `--templates 256,2048`: what preparing each machine shape's template snapshot costs
(`cubeaccel template prepare`: boot, wait for the agent, save), in a fresh template root per run.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from cubeaccel.host.vmm.hypervisor import detect_accel
from cubeaccel.shim.memory import status_kib

LIBC = ctypes.CDLL(None, use_errno=True)
BASE_MIB = 64


def qemu_s(mib: int, prealloc: bool, lock: bool, threads: int = 1) -> float:
    """Spawn → QMP socket present, RSS covering guest RAM and (with lock) VmLck too. VmLck alone is the size
    of the locked mappings, not proof that their pages are there."""
    obj = f"memory-backend-ram,id=m0,size={mib}M,prealloc={'on' if prealloc else 'off'}"
    if threads > 1:
        obj += f",prealloc-threads={threads}"
    accel = detect_accel()[0]
    with tempfile.TemporaryDirectory() as d:
        sock = Path(d) / "qmp.sock"
        argv = [
            "qemu-system-x86_64",
            "-S",
            "-nodefaults",
            "-display",
            "none",
            "-machine",
            "q35,memory-backend=m0",
            "-accel",
            "tcg,tb-size=64" if accel == "tcg" else "kvm",
            "-m",
            f"{mib}M",
            "-object",
            obj,
            "-qmp",
            f"unix:{sock},server=on,wait=off",
        ]
        if lock:
            argv += ["-overcommit", "mem-lock=on"]
        want = (mib << 10) if (lock or prealloc) else 0
        t0 = time.monotonic()
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError("qemu exited (RLIMIT_MEMLOCK?)")
                st = status_kib(proc.pid)
                locked = not lock or st.get("VmLck", 0) >= want
                if sock.exists() and locked and st.get("VmRSS", 0) >= want:
                    return time.monotonic() - t0
                time.sleep(0.001)
        finally:
            proc.kill()
            proc.wait()


def memset_s(mib: int) -> float:
    n = mib << 20
    t0 = time.monotonic()
    buf = mmap.mmap(-1, n)
    ctypes.memset(ctypes.addressof(ctypes.c_char.from_buffer(buf)), 1, n)
    took = time.monotonic() - t0
    buf.close()
    return took


def mlock_s(mib: int) -> float:
    n = mib << 20
    t0 = time.monotonic()
    buf = mmap.mmap(-1, n)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    if LIBC.mlock(ctypes.c_void_p(addr), ctypes.c_size_t(n)) != 0:
        raise OSError(ctypes.get_errno(), "mlock")
    took = time.monotonic() - t0
    LIBC.munlock(ctypes.c_void_p(addr), ctypes.c_size_t(n))
    del addr
    buf.close()
    return took


VARIANTS: dict[str, Any] = {
    "memset": memset_s,
    "mlock": mlock_s,
    "qemu prealloc": lambda m: qemu_s(m, True, False) - qemu_s(BASE_MIB, False, False),
    "qemu lock": lambda m: qemu_s(m, False, True) - qemu_s(BASE_MIB, False, True),
    "qemu prealloc+lock": lambda m: qemu_s(m, True, True) - qemu_s(BASE_MIB, True, True),
    "qemu prealloc+lock threads=2": lambda m: qemu_s(m, True, True, 2) - qemu_s(BASE_MIB, True, True),
    "qemu start (64 MiB, lock)": lambda m: qemu_s(BASE_MIB, True, True),
}


def _mmm(xs: list[float], digits: int = 2) -> list[float]:
    return [round(min(xs), digits), round(statistics.median(xs), digits), round(max(xs), digits)]


def threads_bench(gibs: list[int], threads: list[int], runs: int) -> list[dict[str, Any]]:
    """Each size: one warm-up memset, then `runs` rounds with memset and every thread count interleaved."""
    rows: list[dict[str, Any]] = []
    for gib in gibs:
        mib = gib << 10
        memset_s(mib)
        times: dict[str, list[float]] = {"memset": [], **{f"threads={n}": [] for n in threads}}
        loads: list[float] = []
        for _ in range(runs):
            times["memset"].append(memset_s(mib))
            for n in threads:
                base = qemu_s(BASE_MIB, True, True, n)
                times[f"threads={n}"].append(max(1e-3, qemu_s(mib, True, True, n) - base))
            loads.append(os.getloadavg()[0])
        for name, xs in times.items():
            ratio = [m / x for x, m in zip(xs, times["memset"], strict=True)]  # GiB/s ÷ memset GiB/s
            rows.append(
                {
                    "gib": gib,
                    "variant": "memset" if name == "memset" else f"prealloc+lock {name}",
                    "gib_per_s": _mmm([gib / x for x in xs]),
                    "gibps_vs_memset": _mmm(ratio),
                    "load_1min": _mmm(loads, 1),
                }
            )
    return rows


def template_bench(shapes: list[int], runs: int) -> list[dict[str, Any]]:
    """Template snapshot cost per machine shape, each run from nothing (its own template root)."""
    from cubeaccel.images.builder import build
    from cubeaccel.shim.template import prepare_template, shape_config

    manifest, _ = build()
    rows = []
    for mib in shapes:
        took, size, loads = [], [], []
        for _ in range(runs):
            with tempfile.TemporaryDirectory() as d:
                root = Path(d)
                cfg = shape_config(manifest, mib, 1, root / "prepare")
                t0 = time.monotonic()
                state, _ = prepare_template(cfg, manifest, root)
                took.append(time.monotonic() - t0)
                size.append(state.stat().st_size / 2**20)
            loads.append(os.getloadavg()[0])
        rows.append(
            {"memory_mib": mib, "prepare_s": _mmm(took), "state_mib": _mmm(size, 0), "load_1min": _mmm(loads, 1)}
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", default="1,2")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", default="", help="e.g. 1,2,4: the thread comparison only")
    ap.add_argument("--templates", default="", help="e.g. 256,2048: template snapshot cost per shape only")
    args = ap.parse_args()
    load = os.getloadavg()[0]
    if args.threads or args.templates:
        out: dict[str, Any] = {"bench": "large_guests", "accel": detect_accel()[0], "load_1min_before": load}
        if args.threads:
            gibs = [int(x) for x in args.gib.split(",")]
            out["threads"] = threads_bench(gibs, [int(x) for x in args.threads.split(",")], args.runs)
        if args.templates:
            out["templates"] = template_bench([int(x) for x in args.templates.split(",")], args.runs)
        out["load_1min_after"] = os.getloadavg()[0]
        print(json.dumps(out))
        for r in out.get("threads", []):
            print(
                f"{r['gib']:>3} GiB | {r['variant']:<26} | GiB/s {r['gib_per_s']} | ÷ memset {r['gibps_vs_memset']} "
                f"| load {r['load_1min']}"
            )
        for r in out.get("templates", []):
            print(
                f"{r['memory_mib']:>6} MiB | prepare {r['prepare_s']} s | state {r['state_mib']} MiB "
                f"| load {r['load_1min']}"
            )
        return
    rows: list[dict[str, Any]] = []
    for gib in (int(x) for x in args.gib.split(",")):
        runs: dict[str, list[float]] = {k: [] for k in VARIANTS}
        memset_s(gib << 10)  # warm: a nested guest's first touch of host memory costs several times more
        for _ in range(args.runs):  # interleaved, so drift in the machine's load hits every variant alike
            for name, fn in VARIANTS.items():
                runs[name].append(fn(gib << 10))
        for name, xs in runs.items():
            per_gib = [x / gib for x in xs]
            ratio = [x / m for x, m in zip(xs, runs["memset"], strict=True)]
            rows.append(
                {
                    "gib": gib,
                    "variant": name,
                    "s_per_gib": [round(min(per_gib), 3), round(statistics.median(per_gib), 3), round(max(per_gib), 3)],
                    "vs_memset": [round(min(ratio), 2), round(statistics.median(ratio), 2), round(max(ratio), 2)],
                }
            )
    print(
        json.dumps(
            {"bench": "prealloc_lock", "load_1min_before": load, "load_1min_after": os.getloadavg()[0], "rows": rows}
        )
    )
    print(f"{'GiB':>3} | {'variant':<30} | {'s/GiB min/med/max':<22} | ÷ memset (same run) min/med/max")
    for r in rows:
        print(
            f"{r['gib']:>3} | {r['variant']:<30} | {' / '.join(map(str, r['s_per_gib'])):<22} | "
            + " / ".join(map(str, r["vs_memset"]))
        )


if __name__ == "__main__":
    main()
