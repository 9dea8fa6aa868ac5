"""`cubeaccel shim ...`: one MicroVM per process."""

from __future__ import annotations

import typer

app = typer.Typer(no_args_is_help=True, help="CubeShim: one MicroVM per process")
