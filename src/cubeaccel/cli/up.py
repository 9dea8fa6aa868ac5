"""`cubeaccel up` / `down`: the embedded single node."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cubeaccel.cli import output
from cubeaccel.cli.locate import UP_STATE


def up_cmd(
    state_dir: Annotated[Path, typer.Option(help="master database, Cubelet state, logs")] = UP_STATE,
    backend: Annotated[str, typer.Option(help="auto | simulated | emulated")] = "auto",
    profile: Annotated[str, typer.Option(help="simulated devices")] = "h100x2",
    detach: Annotated[bool, typer.Option(help="return once the node is ready; stop with `cubeaccel down`")] = False,
    warm: Annotated[
        int,
        typer.Option(
            min=0,
            max=64,
            help="warm sandboxes the Cubelet keeps of the backend's default template (0: none; docs/warm.md)",
        ),
    ] = 1,
) -> None:
    """Embedded single node: CubeMaster (SQLite) + one Cubelet, with the best backend this host supports."""
    from cubeaccel.master.up import run_up

    with output.Progress("up") as progress:
        rc = run_up(state_dir, backend, profile, detach, on_phase=progress.phase, warm=warm)
    raise typer.Exit(rc)


def down_cmd(state_dir: Annotated[Path, typer.Option()] = UP_STATE) -> None:
    """Stop what `cubeaccel up --detach` started."""
    from cubeaccel.master.up import run_down

    raise typer.Exit(run_down(state_dir))


def register_top_level(root: typer.Typer) -> None:
    root.command("up")(up_cmd)
    root.command("down")(down_cmd)
