"""`cubeaccel shim ...`: one MicroVM per process (started by Cubelet), plus the lookup Cubelet uses after a crash."""

from __future__ import annotations

from pathlib import Path

import typer

app = typer.Typer(no_args_is_help=True, help="CubeShim: one MicroVM per process")


@app.command("run")
def run(
    sandbox: str = typer.Option(..., "--sandbox", help="sandbox id (must equal the spec's sandbox_id)"),
    spec_file: Path = typer.Option(..., "--spec", help="spec JSON written by Cubelet"),
) -> None:
    """Run one sandbox's MicroVM until SIGTERM; reports go where the spec says."""
    from cubeaccel.shim.entry import run_command

    raise typer.Exit(run_command(sandbox, spec_file))


@app.command("find")
def find(sandbox: str = typer.Argument(..., help="sandbox id")) -> None:
    """Print the pid of the sandbox's VMM (found by its command-line tag), exit 1 when none runs."""
    from cubeaccel.host.vmm.vmmproc import find_vmm

    pid = find_vmm(sandbox)
    if pid is None:
        raise typer.Exit(1)
    print(pid)
