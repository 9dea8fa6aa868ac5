#!/usr/bin/env bash
# GPU smoke check for a host with a real NVIDIA GPU and driver. READ-ONLY.
#
#   scripts/gpu-smoke.sh [OUT_DIR]        (default ./gpu-smoke-out)
#
# Steps, each bounded by a timeout, each result kept even when a step fails:
#   1. facts: uname, python, nvidia-smi *query* (read-only), driver versions from /proc and /sys
#   2. `cubeaccel host check --json` (skipped with a note if cubeaccel's pip deps are missing)
#   3. scripts/gpu-discover.py (read-only sysfs discovery), if present
#   4. `cube-agent probe` against the real driver, with two contracts built from this host's facts:
#      expect-pass (this host's kernel, driver version, NVIDIA modules, /dev files, libcuda, NVML)
#      and expect-fail (wrong driver version, a CUDA no driver has) to show failures naming their layer
#   5. the agent's protocol over stdio: hello, probe, garbage, shutdown
# Exit 0 when the expect-pass contract passed and the expect-fail one failed at kernel_driver, userspace_driver
# and cuda_runtime; 1 otherwise (summary.txt says which).
#
# It never rebinds a driver, resets a device, loads modules or changes persistence mode:
# the agent runs `probe` without --load-modules / --allow-set-persistence and `serve` with
# --no-load-modules --no-set-persistence; the contracts say persistence_mode=false. cuInit and
# nvmlInit open /dev/nvidia* as any CUDA program does; nothing else touches the device. Everything
# written goes under OUT_DIR. The agent path needs only python3 (stdlib) and this checkout's src/.
set -u

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-./gpu-smoke-out}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
PY="${PYTHON:-python3}"
# cubeaccel's own CLI needs its pip deps: use the checkout's venv when there is one.
HOSTPY="$PY"
[ -x "$REPO/.venv/bin/python" ] && HOSTPY="$REPO/.venv/bin/python"
STEP_TIMEOUT="${STEP_TIMEOUT:-120}"
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"

# The agent always runs from this checkout with the standard library only (no pip installs needed).
agent() { PYTHONPATH="$REPO/src" timeout "$STEP_TIMEOUT" "$PY" -m cubeaccel.agent "$@"; }

step() {  # step NAME OUTFILE CMD...: run, keep stdout+stderr, record rc and seconds
  local name="$1" out="$2"; shift 2
  local t0 t1 rc
  t0=$(date +%s.%N)
  "$@" >"$OUT/$out" 2>"$OUT/$out.stderr"
  rc=$?
  t1=$(date +%s.%N)
  printf '%-28s rc=%-3s %6.2fs  %s\n' "$name" "$rc" "$(echo "$t1 - $t0" | bc 2>/dev/null || echo 0)" "$out" | tee -a "$SUMMARY"
  return 0
}

# ---- 1. facts ----------------------------------------------------------------------------------
{
  echo "date: $(date -u +%FT%TZ)"
  echo "uname: $(uname -a)"
  echo "python: $("$PY" --version 2>&1)"
  echo "kernel_release: $(uname -r)"
  echo "sys_module_nvidia_version: $(cat /sys/module/nvidia/version 2>/dev/null || echo absent)"
  echo "proc_driver_nvidia_version: $(head -1 /proc/driver/nvidia/version 2>/dev/null || echo absent)"
  echo "nvidia_modules: $(grep -E '^nvidia' /proc/modules 2>/dev/null | cut -d' ' -f1 | tr '\n' ' ')"
  echo "dev_nvidia: $(ls /dev/nvidia* 2>/dev/null | tr '\n' ' ')"
  echo "libcuda: $(ldconfig -p 2>/dev/null | grep -E 'libcuda\.so\.1|libnvidia-ml\.so\.1' | tr -s ' ' | tr '\n' ';')"
} >"$OUT/facts.txt" 2>&1
if command -v nvidia-smi >/dev/null; then
  step "nvidia-smi query" nvidia-smi.csv timeout "$STEP_TIMEOUT" nvidia-smi \
    --query-gpu=index,pci.bus_id,name,driver_version,memory.total,persistence_mode --format=csv
fi

# ---- 2. host check -----------------------------------------------------------------------------
if PYTHONPATH="$REPO/src" "$HOSTPY" -c 'import typer, rich, cubeaccel.cli' 2>/dev/null; then
  step "cubeaccel host check" host-check.json \
    env PYTHONPATH="$REPO/src" timeout "$STEP_TIMEOUT" "$HOSTPY" -c 'from cubeaccel.cli import main; main()' host check --json
elif command -v cubeaccel >/dev/null; then
  step "cubeaccel host check" host-check.json timeout "$STEP_TIMEOUT" cubeaccel host check --json
else
  echo "cubeaccel host check         skipped: cubeaccel's pip dependencies (typer, rich) are not installed" | tee -a "$SUMMARY"
fi

# ---- 3. discovery ------------------------------------------------------------------------------
if [ -f "$REPO/scripts/gpu-discover.py" ]; then
  step "gpu-discover" discover.json \
    env PYTHONPATH="$REPO/src" timeout "$STEP_TIMEOUT" "$HOSTPY" "$REPO/scripts/gpu-discover.py"
fi

# ---- 4. cube-agent probe against the real driver -----------------------------------------------
PYTHONPATH="$REPO/src" "$PY" - "$OUT" <<'EOF' 2>"$OUT/contracts.stderr"
"""Two probe contracts from this host's own facts (read from /proc and /sys only)."""
import json, os, sys
from pathlib import Path

out = Path(sys.argv[1])
def read(p):
    try:
        return Path(p).read_text().strip()
    except OSError:
        return None

pci = []
base = Path("/sys/bus/pci/devices")
for dev in sorted(base.iterdir()) if base.is_dir() else []:
    vendor, cls = read(dev / "vendor"), read(dev / "class") or ""
    if vendor == "0x10de" and cls[2:4] in ("03", "12"):
        pci.append({"vendor_id": "10de", "device_id": (read(dev / "device") or "0x0000")[2:]})
driver = read("/sys/module/nvidia/version")
if driver is None:  # e.g. in a container: the NVRM banner still names the kernel module's version
    import re
    m = re.search(r"Kernel Module(?: for [^\s]+)?\s+(\d+(?:\.\d+)+)", read("/proc/driver/nvidia/version") or "")
    driver = m[1] if m else None
loaded = {line.split()[0] for line in (read("/proc/modules") or "").splitlines() if line.strip()}
uvm = "nvidia_uvm" in loaded  # loaded on demand by nvidia-modprobe: expected only if already there
gpus = sorted(f"/dev/{n}" for n in os.listdir("/dev") if n.startswith("nvidia") and n[6:].isdigit())
files = ["/dev/nvidiactl", *(gpus[:1] or ["/dev/nvidia0"]), *(["/dev/nvidia-uvm"] if uvm else [])]
libs = [{"name": n, "version": driver, "layer": "userspace_driver"} for n in ("libcuda.so.1", "libnvidia-ml.so.1")]
good = {
    "kernel_release": os.uname().release,
    "modules": ["nvidia", *(["nvidia_uvm"] if uvm else [])],
    "kernel_driver": {"module": "nvidia", "version": driver or "unknown"},
    "device_files": files,
    "libraries": libs,
    "pci": pci or [{"vendor_id": "10de", "device_id": "ffff"}],
    "cuda": {"version": "12.0", "min_driver_api": 12000},
    "persistence_mode": False,
}
bad = {**good, "kernel_driver": {"module": "nvidia", "version": "1.0.0"},
       "libraries": [{**l, "version": "1.0.0"} for l in libs], "cuda": {"version": "99.0", "min_driver_api": 99000}}
(out / "contract-expect-pass.json").write_text(json.dumps(good, indent=2))
(out / "contract-expect-fail.json").write_text(json.dumps(bad, indent=2))
EOF
for kind in pass fail; do
  step "agent probe (expect $kind)" "agent-probe-expect-$kind.json" agent probe --json --contract "$OUT/contract-expect-$kind.json"
  step "agent table (expect $kind)" "agent-probe-expect-$kind.txt" agent probe --contract "$OUT/contract-expect-$kind.json"
done

# ---- 5. the protocol over stdio against the real driver ----------------------------------------
contract="$(cat "$OUT/contract-expect-pass.json" | tr -d '\n')"
printf '%s\n' \
  '{"v":1,"id":1,"method":"hello"}' \
  "{\"v\":1,\"id\":2,\"method\":\"probe\",\"params\":{\"load_modules\":false,\"contract\":$contract}}" \
  'not json at all' \
  '{"v":1,"id":3,"method":"shutdown"}' >"$OUT/serve-requests.jsonl"
step "agent serve --stdio" serve-replies.jsonl \
  agent serve --stdio --no-load-modules --no-set-persistence --max-request-bytes 1048576 <"$OUT/serve-requests.jsonl"

# ---- summary -----------------------------------------------------------------------------------
PYTHONPATH="$REPO/src" "$PY" - "$OUT" <<'EOF' | tee -a "$SUMMARY"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
verdicts = {}
for kind in ("pass", "fail"):
    try:
        reply = json.loads((out / f"agent-probe-expect-{kind}.json").read_text())
    except (OSError, ValueError) as exc:
        print(f"expect-{kind}: no agent reply ({exc})")
        continue
    r = reply["report"]
    print(f"expect-{kind}: ok={reply['ok']} failed={reply['failed']} layers={reply['failed_layers']}")
    print(f"  kernel_driver={r['kernel_driver_version']} cuda={r['cuda']} nvml_count={(r['nvml'] or {}).get('device_count')}")
    print("  probe ms: " + ", ".join(f"{p['name']}={p['duration_ms']:.1f}" for p in r["probes"]))
    verdicts[kind] = reply
good, bad = verdicts.get("pass"), verdicts.get("fail")
fine = bool(good and good["ok"] and bad and not bad["ok"]
            and {"kernel_driver", "cuda_runtime", "userspace_driver"} <= set(bad["failed_layers"]))
print("SMOKE " + ("PASS: the real driver passed its own contract and the wrong one failed at the right layers"
                  if fine else "FAIL: see agent-probe-expect-*.txt"))
sys.exit(0 if fine else 1)
EOF
rc=${PIPESTATUS[0]}
echo "results in $OUT"
exit "$rc"
