"""The `cubeaccel` command tree. Each area owns one module with its own Typer sub-app (entry point: `main`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cubeaccel import __version__
from cubeaccel.cli import (
    api,
    cubelet,
    fleet,
    host,
    identities,
    image,
    master,
    nodes,
    output,
    sandbox,
    shim,
    template,
    up,
)

app = typer.Typer(no_args_is_help=True, add_completion=True, help="GPU sandboxes for Cube Sandbox.")


def _version(value: bool) -> None:
    if value:
        print(f"cubeaccel {__version__}")
        raise typer.Exit(0)


@app.callback()
def root(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_version, is_eager=True, allow_from_autoenv=False, help="print the version and exit"
        ),
    ] = False,
    out: Annotated[
        str, typer.Option("--output", "-o", help="table | json | yaml (also accepted after any command)")
    ] = "table",
    config: Annotated[
        Path | None,
        typer.Option("--config", help="TOML config file (default: $CUBEACCEL_CONFIG, ~/.config/cubeaccel/config.toml)"),
    ] = None,
) -> None:
    """GPU sandboxes for Cube Sandbox."""
    output.set_format_of_invocation(out)


app.add_typer(cubelet.app, name="cubelet")
app.add_typer(host.app, name="host")
app.add_typer(template.app, name="template")
app.add_typer(image.app, name="image")
app.add_typer(shim.app, name="shim")
app.add_typer(master.app, name="master")
app.add_typer(api.app, name="api")
app.add_typer(fleet.app, name="fleet")
cubelet.register_top_level(app)
for area in (identities, nodes, up, sandbox):  # in this order in `--help`
    area.register_top_level(app)
