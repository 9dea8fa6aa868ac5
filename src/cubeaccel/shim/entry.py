"""The shim's command line, shared by `python -m cubeaccel.shim` and the fork server's children (which run the
same `run` command line a spawned shim gets, with their imports already done)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from cubeaccel.protocol.errors import CubeError


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m cubeaccel.shim")
    sub = ap.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run one sandbox's MicroVM until SIGTERM")
    run.add_argument("--sandbox", required=True)
    run.add_argument("--spec", required=True)
    serve = sub.add_parser("serve", help="the fork server: fork ready shims for Cubelet until stdin closes")
    serve.add_argument("--dir", required=True)
    serve.add_argument("--cmdline-room", default="", help=argparse.SUPPRESS)
    return ap


def run(args: argparse.Namespace, workload_token: str | None = None) -> int:
    """`workload_token`: from the fork server's request (a spawned shim reads it from stdin instead)."""
    return run_command(args.sandbox, Path(args.spec), workload_token)


def run_command(sandbox: str, spec_path: Path, workload_token: str | None = None) -> int:
    """`shim run`, for both command lines (this one and `cubeaccel shim run`): 2 for a spec it refuses."""
    from cubeaccel.shim.process import run_shim
    from cubeaccel.wire.shim_spec import load_spec

    try:
        spec = load_spec(spec_path)
        if spec.sandbox_id != sandbox:
            raise CubeError(
                "shim.invalid_spec",
                f"--sandbox {sandbox!r} != spec sandbox_id {spec.sandbox_id!r}",
                layer="template",
                details={"field": "sandbox_id"},
                status=422,
            )
    except CubeError as e:
        print(json.dumps(e.to_json()), file=sys.stderr)
        return 2
    return run_shim(spec, workload_token=workload_token)
