"""`cubeaccel` entry point. Each area owns one module with its own Typer sub-app."""

from __future__ import annotations

import typer

from cubeaccel.cli import api, cubelet, host, image, master, shim, template

app = typer.Typer(no_args_is_help=True, add_completion=False, help="GPU sandboxes for Cube Sandbox.")
app.add_typer(cubelet.app, name="cubelet")
app.add_typer(host.app, name="host")
app.add_typer(template.app, name="template")
app.add_typer(image.app, name="image")
app.add_typer(shim.app, name="shim")
app.add_typer(master.app, name="master")
app.add_typer(api.app, name="api")
cubelet.register_top_level(app)
master.register_top_level(app)


def main() -> None:
    app()
