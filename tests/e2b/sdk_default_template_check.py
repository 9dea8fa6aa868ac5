"""An older e2b SDK line's `Sandbox.create()` with no template (the SDK sends its default, `base`), one command,
kill. Run by a Python whose path has that e2b first; the SDK reads E2B_API_KEY, E2B_API_URL and E2B_SANDBOX_URL.
Prints one JSON line with what it saw."""

from __future__ import annotations

import json
import sys
from importlib.metadata import version

from e2b import Sandbox


def main() -> int:
    sbx = Sandbox.create(request_timeout=300)
    r = sbx.commands.run("echo hi")
    print(
        json.dumps(
            {
                "version": version("e2b"),
                "sandbox_id": sbx.sandbox_id,
                "stdout": r.stdout,
                "exit_code": r.exit_code,
                "killed": sbx.kill(),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
