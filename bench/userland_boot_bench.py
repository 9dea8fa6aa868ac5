"""What the userland flavour costs a cold boot under TCG, beside the validation image (the same-run baseline).

Each run starts `cubeaccel shim run` with a cold start (no template snapshot), one emulated edu device and the
workload bridge, and times spawn → `workload_ready` (the guest's workload service answers) and spawn →
`guest_validated` (cube-agent's verdict; the device attached). Both images boot the same kernel at the same
memory size; only the initrd differs (validation ~57 MB, userland ~120 MB: unpacked into guest RAM). Runs
alternate between the images so load drifts hit both; min/median/max over `--runs` with /proc/loadavg before
each run (the machine is shared). Template-snapshot starts restore guest RAM and do not unpack the initrd again,
so their cost follows memory size, not flavour.

`--baseline-image DIR` boots an image directory of the cache (an earlier build, e.g. of the same flavour before a
change to the guest's init) as the baseline instead of the validation image.

Run: `PYTHONPATH=src:. .venv/bin/python bench/userland_boot_bench.py [--runs 3] [--memory-mib 512]
[--baseline-image ~/.cache/cubeaccel/images/KEY]`.
"""

from __future__ import annotations

import argparse
import json
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from tests.support.vmm_cleanup import kill_started_vmms
from tests.vm.conftest import private_image

from cubeaccel.backends.emulated import slot_address
from cubeaccel.images.builder import cache_dir
from cubeaccel.images.manifest import Manifest
from cubeaccel.images.userland import USERLAND
from cubeaccel.model.device import device_id_for

INSTANCE = uuid.uuid4().hex[:8]


def _reports(path: Path) -> dict[str, float]:
    """First report time per kind."""
    seen: dict[str, float] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                seen.setdefault(r["kind"], float(r.get("at", time.time())))
    return seen


def boot_once(image: Manifest, memory_mib: int, work: Path, slot: int) -> dict[str, float]:
    sandbox = f"bb-{uuid.uuid4().hex[:10]}"
    base = work / sandbox
    base.mkdir()
    spec = {
        "sandbox_id": sandbox,
        "devices": [
            {
                "device_id": device_id_for("emulated", slot_address(slot), INSTANCE),
                "driver": "edu",
                "properties": {},
                "vendor_id": "1234",
                "device_id_hex": "11e8",
            }
        ],
        "memory_mib": memory_mib,
        "vcpus": 1,
        "pin_memory": True,
        "image_manifest": str(image.directory / "manifest.json"),
        "start": "cold",
        "state_dir": str(base / "state"),
        "report": {"file": str(base / "reports.jsonl")},
        "detach_timeout_s": 10.0,
        "boot_timeout_s": 300.0,
        "workload": True,
    }
    (base / "spec.json").write_text(json.dumps(spec))
    main = "from cubeaccel.cli import main; main()"
    cmd = [sys.executable, "-c", main, "shim", "run", "--sandbox", sandbox, "--spec", str(base / "spec.json")]
    t0 = time.time()
    with (base / "shim.log").open("ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=log, stdin=subprocess.PIPE)
    assert proc.stdin is not None
    proc.stdin.write(secrets.token_urlsafe(24).encode() + b"\n")
    proc.stdin.close()
    try:
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline:
            seen = _reports(base / "reports.jsonl")
            if "guest_validated" in seen or "shim_exiting" in seen or proc.poll() is not None:
                break
            time.sleep(0.2)
        if "guest_validated" not in seen:
            reports = (base / "reports.jsonl").read_text()[-1500:] if (base / "reports.jsonl").exists() else ""
            raise RuntimeError(f"{image.key}: no guest_validated: {sorted(seen)}: {reports}")
        return {"workload_ready": seen["workload_ready"] - t0, "guest_validated": seen["guest_validated"] - t0}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        kill_started_vmms(base)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--memory-mib", type=int, default=512)
    ap.add_argument("--baseline-image", type=Path, default=None)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="userland-boot-bench-"))
    # This run's own copies (hard links): other builders sharing the cache prune it while we boot.
    if args.baseline_image is not None:
        copy = shutil.copytree(args.baseline_image, work / "baseline" / args.baseline_image.name)
        baseline = ("baseline", Manifest.load(Path(copy) / "manifest.json"))
    else:
        baseline = ("validation", private_image(cache_dir(), work / "cache"))
    images = dict([baseline, ("userland", private_image(cache_dir(), work / "cache", flavour=USERLAND))])
    results: dict[tuple[str, str], list[float]] = {}
    loads: list[str] = []
    try:
        for i in range(args.runs):
            for j, (name, image) in enumerate(images.items()):
                loads.append(Path("/proc/loadavg").read_text().split()[0])
                for phase, took in boot_once(image, args.memory_mib, work, 20 + 2 * i + j).items():
                    results.setdefault((name, phase), []).append(took)
        for name, image in images.items():
            print(f"{name:10s} initrd {image.path(image.initrd).stat().st_size / 1e6:6.1f} MB  {image.key}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for (name, phase), secs in sorted(results.items()):
        print(
            f"{name:10s} {phase:16s} n={len(secs)} min {min(secs):6.1f} s  median {statistics.median(secs):6.1f} s"
            f"  max {max(secs):6.1f} s"
        )
    for phase in ("workload_ready", "guest_validated"):
        ratio = statistics.median(results[("userland", phase)]) / statistics.median(results[(baseline[0], phase)])
        print(f"userland / {baseline[0]}, {phase} (median): {ratio:.2f}")
    print(f"load before each run: {','.join(loads)}")


if __name__ == "__main__":
    main()
