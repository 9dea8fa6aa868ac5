"""`python -m cubeaccel.shim run --sandbox ID --spec FILE`: the same as `cubeaccel shim run`, without loading
the whole CLI (typer and every area's sub-app): ~0.2 s less per sandbox start, measured by bench/shim_bench.py.
"""

from __future__ import annotations

import argparse
import json
import sys

from cubeaccel.model.errors import CubeError


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cubeaccel.shim")
    sub = ap.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run one sandbox's MicroVM until SIGTERM")
    run.add_argument("--sandbox", required=True)
    run.add_argument("--spec", required=True)
    args = ap.parse_args(argv)
    from pathlib import Path

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
    return run_shim(spec)


if __name__ == "__main__":
    sys.exit(main())
