"""`cubeaccel` entry point: read the config file, then build the command tree and run it.

The config file is read before the command modules are imported: some defaults (state directories) are read from
the environment when a module is imported, and the file's environment-backed settings are exported first.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any


def _pop_config(argv: list[str]) -> tuple[list[str], Path | None]:
    """`--config FILE` / `--config=FILE` before the command (the root option's place)."""
    out: list[str] = []
    path: Path | None = None
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--":
            out += argv[i:]
            break
        if a == "--config" and i + 1 < len(argv):
            path, i = Path(argv[i + 1]), i + 2
            continue
        if a.startswith("--config="):
            path = Path(a.split("=", 1)[1])
        else:
            out.append(a)
        i += 1
    return out, path


def main() -> None:
    import typer

    from cubeaccel.cli import config, output
    from cubeaccel.protocol.errors import CubeError

    try:
        argv, explicit = _pop_config(sys.argv[1:])
        argv = output.pop_output(argv)
    except typer.BadParameter as e:
        print(f"error: {e.message}", file=sys.stderr)
        raise SystemExit(2) from e
    try:
        path, _, tables = config.prepare(explicit)
        from cubeaccel.cli.root import app

        defaults = config.default_map(typer.main.get_command(app), tables, path) if path is not None else {}
    except CubeError as e:
        try:
            output.fail(e, 2)
        except typer.Exit as done:
            raise SystemExit(done.exit_code) from e
    app(args=argv, prog_name="cubeaccel", default_map=defaults, auto_envvar_prefix="CUBEACCEL")


def __getattr__(name: str) -> Any:
    if name == "app":  # `from cubeaccel.cli import app` (tests, CliRunner)
        from cubeaccel.cli.root import app

        return app
    raise AttributeError(name)
