"""What a confined VMM really locks, per machine shape, against the pinned-memory ledger's charge (issue 30 #8).

Each run reserves and starts one sandbox of the shape on an emulated Cubelet (real shim, real confined QEMU, TCG
here), keeps the peak VmLck of its VMM from its start until 5 s after the guest was validated, then releases it.
Prints one JSON line and a table: peak VmLck above guest RAM (min/median/max over the runs) beside the ledger's
charge above guest RAM, with /proc/loadavg before and after (the machine is shared).

Run: `PYTHONPATH=src:. .venv/bin/python bench/vmm_locked_bench.py [--shapes 256:1,1024:1,1024:2] [--runs 3]`.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

from tests.support.cubelet_process import CubeletProcess
from tests.support.poll import poll
from tests.support.vmlck import measure_locked
from tests.support.vmm_cleanup import kill_started_vmms
from tests.vm.conftest import SHARED_CACHE, private_image
from tests.vm.test_cubelet_emulated import edu_contract


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="256:1,1024:1,1024:2")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    shapes = [tuple(int(x) for x in s.split(":")) for s in args.shapes.split(",")]
    base = Path(tempfile.mkdtemp(prefix="vmlck-bench-"))
    os.environ["CUBEACCEL_CACHE_DIR"] = str(base / "cache")  # a private copy: no other build prunes it mid-run
    contract = edu_contract(private_image(SHARED_CACHE, base / "cache"))
    # No scrub VM between runs (one boot fewer each): what is measured is the sandbox's VMM.
    args_ = ("--backend", "emulated", "--release-timeout", "20", "--scrub", "accelerator=none")
    (base / "node").mkdir()
    p = CubeletProcess(base / "node", "-", *args_).start()
    results: dict[str, Any] = {"load_before": Path("/proc/loadavg").read_text().split()[:3], "shapes": {}}
    try:

        def vmm_gone(sid: str) -> bool:
            return p.vmm(sid) is None

        for mib, vcpus in shapes:
            above, charged = [], 0
            for run in range(args.runs):
                sid = f"bench-{mib}-{vcpus}-{run}"
                s = measure_locked(p, sid, contract, mib, vcpus)
                above.append(round(s.vmm_above_guest_mib, 1))
                print(f"{sid}: peak VmLck {s.peak_vmlck_kib} KiB, charged {s.charge_mib} MiB", flush=True)
                charged = s.charge_mib - mib
                p.client.release(sid)
                poll(functools.partial(vmm_gone, sid), 120, what=f"{sid}'s VMM gone")
            results["shapes"][f"{mib}:{vcpus}"] = {
                "vmlck_above_guest_mib": {"min": min(above), "median": statistics.median(above), "max": max(above)},
                "runs": above,
                "ledger_above_guest_mib": charged,
            }
        results["load_after"] = Path("/proc/loadavg").read_text().split()[:3]
    finally:
        p.stop()
        kill_started_vmms(base)
    print(json.dumps(results))
    for shape, r in results["shapes"].items():
        v = r["vmlck_above_guest_mib"]
        print(f"{shape:<8} VmLck above guest min {v['min']} median {v['median']} max {v['max']} MiB; ledger charges "
              f"{r['ledger_above_guest_mib']} MiB above guest")  # fmt: skip
    print("load", results["load_before"], "→", results.get("load_after"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
