"""E2B's network options through an older SDK line, against the front door's REST surface only (no envd).
Run by a Python whose path has that SDK first (a line with `update_network` also updates one running sandbox).
Usage: sdk_network_check.py TEMPLATE TAG; the SDK reads
E2B_API_KEY, E2B_API_URL and E2B_SANDBOX_URL. Prints one JSON line: per case, the sandbox id or the error."""

from __future__ import annotations

import json
import sys
from importlib.metadata import version
from typing import Any

from e2b import Sandbox

CASES: dict[str, dict[str, Any]] = {
    "deny_some": {"network": {"deny_out": ["10.1.2.0/24"]}},
    "no_internet": {"allow_internet_access": False},
    "by_name": {"network": {"allow_out": ["api.example.com"], "deny_out": ["0.0.0.0/0"]}},
    "widened": {"network": {"allow_out": ["198.51.100.7"], "deny_out": ["0.0.0.0/0"]}},
}


def main() -> int:
    template, tag = sys.argv[1], sys.argv[2]
    out: dict[str, Any] = {"version": version("e2b")}
    for name, kw in CASES.items():
        try:
            sbx = Sandbox.create(template, metadata={"suite": tag}, request_timeout=60, **kw)
        except Exception as e:  # the refusal, as this SDK line raises it
            out[name] = {"error": f"{type(e).__name__}: {e}"}
        else:
            out[name] = {"sandbox_id": sbx.sandbox_id}
            sbx.kill()
    if hasattr(Sandbox, "update_network"):  # a running sandbox's egress, replaced whole (2.45 has it, 2.15 not)
        sbx = Sandbox.create(template, metadata={"suite": tag}, request_timeout=60, **CASES["deny_some"])
        try:
            sbx.update_network({"deny_out": ["10.9.0.0/16"]})
            out["updated"] = {"sandbox_id": sbx.sandbox_id}
        except Exception as e:
            out["updated"] = {"error": f"{type(e).__name__}: {e}"}
        finally:
            sbx.kill()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
