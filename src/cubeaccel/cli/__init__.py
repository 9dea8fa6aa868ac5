"""`cubeaccel` entry point. Each area owns one module with its own Typer sub-app."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from cubeaccel import __version__
from cubeaccel.cli import cubelet, host, image, master, output, shim, template

app = typer.Typer(no_args_is_help=True, add_completion=True, help="GPU sandboxes for Cube Sandbox.")


def _version(value: bool) -> None:
    if value:
        print(f"cubeaccel {__version__}")
        raise typer.Exit(0)


@app.callback()
def root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="print the version and exit")
    ] = False,
    out: Annotated[
        str, typer.Option("--output", "-o", help="table | json | yaml (also accepted after any command)")
    ] = "table",
) -> None:
    """GPU sandboxes for Cube Sandbox."""
    if out != "table":
        output.set_format(out)


app.add_typer(cubelet.app, name="cubelet")
app.add_typer(host.app, name="host")
app.add_typer(template.app, name="template")
app.add_typer(image.app, name="image")
app.add_typer(shim.app, name="shim")
app.add_typer(master.app, name="master")
cubelet.register_top_level(app)
master.register_top_level(app)


def main() -> None:
    try:
        argv = output.pop_output(sys.argv[1:])
    except typer.BadParameter as e:
        print(f"error: {e.message}", file=sys.stderr)
        raise SystemExit(2) from e
    app(args=argv, prog_name="cubeaccel")
