"""Kill a sandbox while a command streams, with whichever e2b SDK line is first on the path: what does the
waiting command raise? Usage: sdk_kill_check.py TEMPLATE; the SDK reads E2B_API_KEY, E2B_API_URL and
E2B_SANDBOX_URL. Prints one JSON line: the SDK version, the sandbox id, the exception's class names and message."""

from __future__ import annotations

import json
import sys
from importlib.metadata import version

from e2b import Sandbox


def main() -> int:
    sbx = Sandbox.create(sys.argv[1], timeout=600, request_timeout=300)
    cmd = sbx.commands.run("sleep 120", background=True)
    killed = sbx.kill()
    raised: BaseException | None = None
    try:
        cmd.wait()
    except Exception as e:  # what the SDK makes of the cut stream is the point
        raised = e
    out = {
        "version": version("e2b"),
        "sandbox_id": sbx.sandbox_id,
        "killed": killed,
        "raised": [c.__name__ for c in type(raised).__mro__] if raised else [],
        "message": str(raised),
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
