"""Lab guest runner: runs the scenarios named by `lab.plan=` on the kernel command line, one JSON line each.

Lines start with `LAB ` on the serial console; `LAB {"done": ...}` ends the run. A scenario that raises is reported
with its traceback and the run goes on; one that hangs is cut off by SIGALRM after `lab.timeout=` seconds.
"""

from __future__ import annotations

import importlib
import json
import signal
import sys
import time
import traceback
from typing import Any

sys.path[:0] = ["/lab", "/opt/cubeaccel"]


def emit(obj: dict[str, Any]) -> None:
    sys.stdout.write("LAB " + json.dumps(obj, default=str) + "\n")
    sys.stdout.flush()


class Timeout(Exception):
    pass


def _alarm(_signum: int, _frame: object) -> None:
    raise Timeout("scenario timed out")


def main() -> None:
    with open("/proc/cmdline") as f:
        words = f.read().split()
    args = dict(w.split("=", 1) for w in words if w.startswith("lab.") and "=" in w)
    plan = [p for p in args.get("lab.plan", "").split(",") if p]
    timeout = int(args.get("lab.timeout", "60"))
    t0 = time.monotonic()
    registry: dict[str, Any] = {}
    for mod in args.get("lab.modules", "scenarios").split(","):
        registry.update(importlib.import_module(mod).SCENARIOS)
    emit({"ready": True, "import_s": round(time.monotonic() - t0, 3)})
    signal.signal(signal.SIGALRM, _alarm)
    for name in plan:
        start = time.monotonic()
        signal.alarm(timeout)
        try:
            if name not in registry:
                raise KeyError(f"no scenario {name!r}")
            result = registry[name]()
            emit({"scenario": name, "ok": True, "result": result, "elapsed_s": round(time.monotonic() - start, 3)})
        except BaseException:
            emit({"scenario": name, "ok": False, "error": traceback.format_exc()[-3000:]})
        finally:
            signal.alarm(0)
    emit({"done": True, "total_s": round(time.monotonic() - t0, 3)})


if __name__ == "__main__":
    main()
