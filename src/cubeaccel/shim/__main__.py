"""`python -m cubeaccel.shim run --sandbox ID --spec FILE`: the same as `cubeaccel shim run`, without loading
the whole CLI (typer and every area's sub-app): ~0.2 s less per sandbox start, measured by bench/shim_bench.py.

`python -m cubeaccel.shim serve --dir DIR --cmdline-room ...`: the fork server (shim/forkserver.py) Cubelet
starts once, which forks `run`s with their imports already done.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from cubeaccel.model.errors import CubeError


def main(argv: list[str] | None = None, workload_token: str | None = None) -> int:
    """`workload_token`: from the fork server's request (a spawned shim reads it from stdin instead)."""
    ap = argparse.ArgumentParser(prog="python -m cubeaccel.shim")
    sub = ap.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run one sandbox's MicroVM until SIGTERM")
    run.add_argument("--sandbox", required=True)
    run.add_argument("--spec", required=True)
    serve = sub.add_parser("serve", help="the fork server: fork ready shims for Cubelet until stdin closes")
    serve.add_argument("--dir", required=True)
    serve.add_argument("--cmdline-room", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.command == "serve":
        from cubeaccel.shim.forkserver import serve as serve_forks

        return serve_forks(Path(args.dir))
    from cubeaccel.shim.process import run_shim
    from cubeaccel.wire.shim_spec import load_spec

    try:
        spec = load_spec(Path(args.spec))
        if spec.sandbox_id != args.sandbox:
            raise CubeError(
                "shim.invalid_spec",
                f"--sandbox {args.sandbox!r} != spec sandbox_id {spec.sandbox_id!r}",
                layer="template",
                details={"field": "sandbox_id"},
                status=422,
            )
    except CubeError as e:
        print(json.dumps(e.to_json()), file=sys.stderr)
        return 2
    return run_shim(spec, workload_token=workload_token)


if __name__ == "__main__":
    sys.exit(main())
