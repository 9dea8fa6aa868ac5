"""The E2B SDK's 2.15 line (the one Cube Sandbox pins) against the front door: create (`POST /sandboxes`), run,
connect (a REST call carrying envd's routing headers in this line; the connected sandbox's envd calls carry only
its token), kill. Run by a Python whose path has e2b 2.15.x first. Usage: sdk_215_check.py TEMPLATE; the SDK
reads E2B_API_KEY, E2B_API_URL and E2B_SANDBOX_URL. Prints one JSON line with what it saw."""

from __future__ import annotations

import json
import sys
from importlib.metadata import version

from e2b import Sandbox


def main() -> int:
    sbx = Sandbox.create(sys.argv[1], envs={"LINE": "2.15"}, timeout=600, request_timeout=300)
    r = sbx.commands.run("echo $LINE; uname -s")
    again = Sandbox.connect(sbx.sandbox_id)
    out = {
        "connected": again.sandbox_id == sbx.sandbox_id and again.commands.run("true").exit_code == 0,
        "version": version("e2b"),
        "sandbox_id": sbx.sandbox_id,
        "stdout": r.stdout,
        "exit_code": r.exit_code,
        "killed": sbx.kill(),
        "killed_again": Sandbox.kill(sbx.sandbox_id),
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
