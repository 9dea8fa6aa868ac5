"""What the scrub between tenants costs: the trusted scrub VM's boot, zero and verify, per release.

A real emulated Cubelet (QEMU under TCG here), N times: a tenant starts and is released, then the scrub VM runs on
its device. Per run, from the `scrub_finished` event: the whole scrub (scrub_started → scrub_finished, which
includes the second reset and revalidation's host work), the scrub VM process (spawn → exit), its VMM start (or
template restore), boot/restore to agent, hot-plug to visible, the agent's scrub call (zero + verify + the
round trip), zero and verify inside the guest, detach and VMM exit; and release → allocatable. min/median/max,
with /proc/loadavg (the machine is shared). `--vm-start cold` boots the scrub VM from scratch instead of the
template snapshot.

Run: `PYTHONPATH=src:. .venv/bin/python bench/scrub_bench.py [--runs 3] [--vm-start template|cold]`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.support.cubelet_process import CubeletProcess
from tests.support.poll import poll
from tests.support.vmm_cleanup import kill_started_vmms

from cubeaccel.images.builder import build


def one_run(p: CubeletProcess, i: int) -> dict[str, Any]:
    sid = f"bench-{i}"
    dev = p.client.reserve(sid, 1, start=True, memory_mib=256).devices[0].id

    def running() -> bool:
        res = p.client.reservation(sid).reservation
        return res is not None and res.phase == "running"

    def state() -> str:
        return next(d.state for d in p.client.devices() if d.id == dev)

    poll(running, 180)
    t0 = time.monotonic()
    p.client.release(sid)
    poll(lambda: state() != "releasing", 120)

    def finished() -> dict[str, Any] | None:
        evs = p.client.events(0, 10000, sandbox_id=sid).events
        return next((e.details for e in evs if e.kind == "scrub_finished"), None)

    d = poll(finished, 600)
    poll(lambda: state() == "allocatable", 60)
    release_to_allocatable = time.monotonic() - t0
    tl = d.get("timeline") or {}
    assert d["ok"], d
    return {
        "run": i,
        "loadavg": Path("/proc/loadavg").read_text().split()[:3],
        "scrub_s": d["duration_s"],
        "scrub_vm_process_s": d["vm_s"],
        "vmm_start_s": tl.get("vmm_start_s"),
        "to_agent_s": tl.get("restore_to_agent_s", tl.get("boot_to_agent_s")),
        "hotplug_to_visible_s": tl.get("hotplug_to_visible_s"),
        "agent_scrub_call_s": tl.get("scrub_s"),
        "zero_ms": d.get("zero_ms"),
        "verify_ms": d.get("verify_ms"),
        "bytes": d.get("bytes_zeroed"),
        "detach_and_exit_s": round((tl.get("detach_s") or 0) + (tl.get("vmm_exit_s") or 0), 4),
        "release_to_allocatable_s": round(release_to_allocatable, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--vm-start", default="template", choices=("template", "cold"))
    args = ap.parse_args()
    image, _ = build()  # the image with this tree's agent (the scrub VM boots the one carrying it)
    print(json.dumps({"image": image.image_digest, "agent_sha256": image.agent_sha256}), flush=True)
    rows = []
    d = Path(tempfile.mkdtemp(prefix="scrub-bench-"))  # kept when a run fails: its logs say why
    p = CubeletProcess(d, "-", "--backend", "emulated", "--vm-start", args.vm_start)
    p.start()
    try:
        for i in range(args.runs):
            rows.append(one_run(p, i))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        p.stop()
        kill_started_vmms(d)
    shutil.rmtree(d, ignore_errors=True)
    for key in [k for k in rows[0] if k not in ("run", "loadavg", "bytes")]:
        xs = [float(r[key]) for r in rows if r[key] is not None]
        if xs:
            print(f"{key}: min {min(xs):.3f} median {statistics.median(xs):.3f} max {max(xs):.3f} (n={len(xs)})")


if __name__ == "__main__":
    main()
