"""`cubeaccel cubelet ...` and the node-level verbs (`devices`, `events`, `demo`)."""

from __future__ import annotations

import typer

app = typer.Typer(no_args_is_help=True, help="Cubelet: the node-local owner of every accelerator.")


def register_top_level(root: typer.Typer) -> None:
    """Node verbs operators type most (`cubeaccel devices`) live at the top level."""
