"""`python -m cubeaccel.shim run --sandbox ID --spec FILE`: the same as `cubeaccel shim run`, without loading
the whole CLI (typer and every area's sub-app): ~0.2 s less per sandbox start, measured by bench/shim_bench.py.

`python -m cubeaccel.shim serve --dir DIR --cmdline-room ...`: the fork server (shim/forkserver.py) Cubelet
starts once, which forks `run`s with their imports already done.
"""

from __future__ import annotations

import sys
from pathlib import Path

from cubeaccel.shim import entry


def main(argv: list[str] | None = None) -> int:
    args = entry.parser().parse_args(argv)
    if args.command == "serve":
        from cubeaccel.shim.forkserver import serve

        return serve(Path(args.dir))
    return entry.run(args)


if __name__ == "__main__":
    sys.exit(main())
