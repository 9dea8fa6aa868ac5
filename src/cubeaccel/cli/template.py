"""`cubeaccel template ...`: validate a template file offline and show what a sandbox would freeze.

`validate` runs the registration stage (`check_template`) exactly as CubeMaster will, so an operator sees
every layer-named violation before registering. Exit status: 0 consistent, 1 violations or unreadable.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from cubeaccel.model.contract import ContractViolation, check_template, freeze
from cubeaccel.model.errors import CubeError
from cubeaccel.wire.templates import load_template

app = typer.Typer(no_args_is_help=True, help="accelerator templates: validate and show")

FileArg = typer.Argument(..., help="template file (.yaml, .yml or .json)", show_default=False)
AsJson = typer.Option(False, "--json", help="print JSON instead of a table")


def _violations_table(title: str, rows: list[ContractViolation]) -> Table:
    # Layer and code are what scripts and people grep for: never wrapped or cut, whatever the width.
    table = Table(title=title, show_lines=True)
    table.add_column("layer", no_wrap=True, min_width=max(len(v.layer.value) for v in rows))
    table.add_column("code", no_wrap=True, min_width=max(len(v.code) for v in rows))
    for name, width in (("expected", 18), ("found", 14), ("hint", 20)):
        table.add_column(name, overflow="fold", min_width=width)
    for v in rows:
        table.add_row(v.layer.value, v.code, escape(v.expected), escape(v.found), escape(v.hint))
    return table


def _console(stderr: bool = False) -> Console:
    """A terminal gets its own width; a pipe or a log gets a wide one, so table rows stay readable."""
    probe = Console(stderr=stderr)
    return probe if probe.is_terminal else Console(stderr=stderr, width=200)


def _load_error(file: Path, e: CubeError, as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps({"file": str(file), "ok": False, **e.to_json()}, indent=2))
    else:
        console = _console(stderr=True)
        console.print(f"[red]invalid template[/] {escape(str(file))}: [bold]{e.code}[/] ({e.layer})")
        console.print(escape(e.message))
        for err in e.details.get("errors", [])[1:]:
            console.print(f"  {escape(err['field'])}: {escape(err['message'])} [dim]({err['code']})[/]")
    raise typer.Exit(1)


@app.command("validate")
def validate(file: Path = FileArg, as_json: bool = AsJson) -> None:
    """Check a template's internal consistency (registration stage). Exit 1 on any violation."""
    try:
        t = load_template(file)
    except CubeError as e:
        _load_error(file, e, as_json)
        return
    violations = check_template(t)
    ok = not violations
    if as_json:
        out: dict[str, Any] = {
            "file": str(file),
            "ok": ok,
            "template": {"name": t.name, "version": t.version},
            "violations": [v.to_json() for v in violations],
        }
        if ok:
            out["template"]["digest"] = freeze(t).digest
        typer.echo(json.dumps(out, indent=2))
    else:
        console = _console()
        if ok:
            console.print(
                f"[green]ok[/]: {escape(t.name)} version {escape(t.version)} is consistent "
                f"(contract digest {freeze(t).digest})"
            )
        else:
            title = f"{escape(t.name)} version {escape(t.version)}: {len(violations)} violation(s)"
            console.print(_violations_table(title, violations))
    raise typer.Exit(0 if ok else 1)


@app.command("show")
def show(file: Path = FileArg, as_json: bool = AsJson) -> None:
    """Show the template as it would be frozen into a sandbox: canonical document, digest, guest probes."""
    try:
        t = load_template(file)
    except CubeError as e:
        _load_error(file, e, as_json)
        return
    contract = freeze(t)
    if as_json:
        typer.echo(json.dumps(contract.to_json(), indent=2))
        return
    console = _console()
    table = Table("field", "value", title=f"template {escape(t.name)} version {escape(t.version)}")
    rows: list[tuple[str, str]] = [
        ("digest", contract.digest),
        ("class / backend", f"{t.accel_class} / {t.backend}"),
        ("devices", ", ".join(d.vendor_device + (f" {d.labels}" if d.labels else "") for d in t.devices) or "-"),
        ("guest image", t.guest_image_digest),
        ("guest kernel", f"{t.guest_kernel.version} ({t.guest_kernel.digest})"),
        ("modules.img", f"{t.modules_img.kernel_version} ({t.modules_img.digest})"),
        ("kernel driver", f"{t.kernel_driver.module} {t.kernel_driver.version}" if t.kernel_driver else "-"),
        ("user-space driver", t.userspace_driver.version if t.userspace_driver else "-"),
        ("CUDA", f"{t.cuda.version} ({t.cuda.compatibility})" if t.cuda else "-"),
        ("memory", f"{t.memory_mib} MiB, {'pinned' if t.pin_memory else 'not pinned'}"),
        ("hot-plug", "yes" if t.hotplug else "no"),
    ]
    for k, v in rows:
        table.add_row(k, escape(v))
    console.print(table)
    console.print("guest probes (what cube-agent checks):")
    console.print_json(json.dumps(contract.guest_probes().to_json()))
    problems = check_template(t)
    if problems:
        console.print(f"[yellow]{len(problems)} violation(s)[/]: run `cubeaccel template validate {escape(str(file))}`")
