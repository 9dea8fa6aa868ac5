"""An older E2B SDK line against the front door's REST surface only (no envd): create, get_info, list, kill.
Run by a Python whose path has that SDK first. Usage: sdk_rest_check.py TEMPLATE TAG; the SDK reads E2B_API_KEY,
E2B_API_URL and E2B_SANDBOX_URL. Prints one JSON line with what it saw."""

from __future__ import annotations

import json
import sys
from importlib.metadata import version

from e2b import Sandbox, SandboxQuery


def main() -> int:
    template, tag = sys.argv[1], sys.argv[2]
    sbx = Sandbox.create(template, metadata={"suite": tag}, request_timeout=60)
    info = sbx.get_info()
    listed = Sandbox.list(query=SandboxQuery(metadata={"suite": tag})).next_items()
    out = {
        "version": version("e2b"),
        "sandbox_id": sbx.sandbox_id,
        "template": info.template_id,
        "listed": [s.sandbox_id for s in listed],
        "killed": sbx.kill(),
        "killed_again": Sandbox.kill(sbx.sandbox_id),
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
