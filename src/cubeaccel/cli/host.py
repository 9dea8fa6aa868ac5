"""`cubeaccel host ...`: is this host ready for VFIO passthrough, and which accelerators does it have.

Both commands are read-only: the host is opened with `read_only=True`, so nothing here can write sysfs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from cubeaccel.backends import nvidia
from cubeaccel.backends.scrub_methods import kind_key, method_for
from cubeaccel.backends.vfio import VfioBackend
from cubeaccel.host.pci.base import function_json
from cubeaccel.host.pci.readiness import Check, HostReadiness, Status, check_host
from cubeaccel.host.pci.sysfs import SysfsPciHost
from cubeaccel.images.scrub_image import ScrubImages
from cubeaccel.model.device import DiscoveredDevice
from cubeaccel.protocol.errors import CubeError

app = typer.Typer(no_args_is_help=True, help="host readiness and discovery (read-only)")

SysfsRoot = typer.Option(Path("/sys"), "--sysfs-root", help="sysfs root (a fake tree in tests)")
DevRoot = typer.Option(Path("/dev"), "--dev-root", help="/dev root")
ProcRoot = typer.Option(Path("/proc"), "--proc-root", help="/proc root")
AsJson = typer.Option(False, "--json", help="print JSON instead of a table")

_MARK = {Status.PASS: "[green]pass[/]", Status.FAIL: "[red]FAIL[/]", Status.WARN: "[yellow]warn[/]"}


@app.command("check")
def check(
    sysfs_root: Path = SysfsRoot,
    dev_root: Path = DevRoot,
    proc_root: Path = ProcRoot,
    as_json: bool = AsJson,
    allow: list[str] = typer.Option(["10de:*"], "--allow", help="the Cubelet's --allow: whose scrub image to check"),
    scrub_image: str | None = typer.Option(None, "--scrub-image", help="the Cubelet's --scrub-image digest"),
) -> None:
    """Check VFIO passthrough prerequisites. Exits 1 when the host cannot pass devices through."""
    result = check_host(sysfs_root, dev_root, proc_root)
    # Vendor facts are the vendor backend's: the GPUs it will keep out on this host, and why.
    host = SysfsPciHost(sysfs_root, read_only=True)
    functions = host.functions()
    fabric = nvidia.Fabric.of(functions)
    try:
        devices = VfioBackend(host, allow=allow).discover()
    except CubeError as e:
        typer.echo(json.dumps(e.to_json()), err=True)
        raise typer.Exit(2) from e
    scrub_checks, scrub_facts = _scrub_images(devices, scrub_image)
    result = HostReadiness(
        (*result.checks, nvidia.fabric_check(functions), *scrub_checks),
        {**result.facts, **fabric.facts(), "scrub_images": scrub_facts},
    )
    if as_json:
        typer.echo(json.dumps(result.to_json(), indent=2))
    else:
        console = Console()
        table = Table("check", "status", "reason", title="VFIO passthrough readiness")
        for c in result.checks:
            table.add_row(c.name, _MARK[c.status], c.reason + (f" [dim]({c.code})[/]" if c.code else ""))
        console.print(table)
        if result.ready:
            console.print("[green]ready[/]: this host can pass PCI devices through")
        else:
            names = ", ".join(c.name for c in result.failures)
            console.print(f"[red]not ready[/]: this host cannot pass PCI devices through ({names})")
    raise typer.Exit(0 if result.ready else 1)


@app.command("discover")
def discover(
    sysfs_root: Path = SysfsRoot,
    allow: list[str] = typer.Option(["10de:*"], "--allow", help="vendor:device[@address] pattern (repeatable)"),
    show_all: bool = typer.Option(False, "--all", help="also list every PCI function"),
    as_json: bool = AsJson,
) -> None:
    """List the accelerators the VFIO backend would manage (and, with --all, every PCI function)."""
    host = SysfsPciHost(sysfs_root, read_only=True)
    try:
        backend = VfioBackend(host, allow=allow)
    except CubeError as e:
        typer.echo(json.dumps(e.to_json()), err=True)
        raise typer.Exit(2) from e
    devices = backend.discover()
    functions = host.functions() if show_all else []
    if as_json:
        out: dict[str, Any] = {
            "allow": list(backend.allow),
            "accelerators": [
                {**function_json(f), "class_name": d.accel_class.value, "labels": d.labels}
                for d in devices
                if (f := host.function(d.address)) is not None
            ],
        }
        if show_all:
            out["functions"] = [function_json(f) for f in functions]
        typer.echo(json.dumps(out, indent=2))
        return
    console = Console()
    table = Table("address", "id", "class", "model", "numa", "group", "driver", title="accelerators")
    for d in devices:
        table.add_row(
            str(d.address), d.identity.vendor_device, d.accel_class.value, d.labels.get("model", ""),
            str(d.numa_node), _opt(d.iommu_group), d.driver or "-",
        )  # fmt: skip
    console.print(table if devices else f"no accelerators match {list(backend.allow)}")
    if show_all:
        table = Table("address", "id", "class", "numa", "group", "driver", "reset", title="all PCI functions")
        for f in functions:
            table.add_row(
                str(f.address), f.identity.vendor_device, f"{f.class_code:06x}", str(f.numa_node),
                _opt(f.iommu_group), f.driver or "-", " ".join(f.reset_method) or "-",
            )  # fmt: skip
        console.print(table)


def _scrub_images(devices: list[DiscoveredDevice], named: str | None) -> tuple[list[Check], dict[str, str | None]]:
    """One line per scrub image the host's accelerators need under policy trusted-vm (the default): a warning, not
    a failure, like the NVSwitch line: the host can pass devices through, the Cubelet holds back the devices of a
    kind whose scrub VM could not boot. Facts: stack → the image's digest."""
    from cubeaccel.images.builder import agent_digest, cache_dir, cached_images

    stacks: dict[str, list[str]] = {}
    for d in devices:
        method = method_for(d.identity)
        if method is not None and method.needs_vm:
            stacks.setdefault(method.image_stack, []).append(kind_key(d.identity))
    if not stacks:
        return [Check("scrub_image", Status.PASS, "no accelerator here boots a scrub VM between tenants")], {}
    images = ScrubImages(named, images=lambda: cached_images(cache_dir()), agent=agent_digest)
    checks, facts = [], {}
    for stack, kinds in sorted(stacks.items()):
        chosen = images.choose(stack)
        name = f"scrub_image_{stack or 'cpu'}"
        facts[stack or "cpu"] = chosen.digest if chosen.usable else None
        whose = f"{len(kinds)} device(s) ({', '.join(sorted(set(kinds)))})"
        if chosen.code is not None:
            checks.append(
                Check(name, Status.WARN, f"{chosen.message}; until then the Cubelet holds {whose}", chosen.code)
            )
        else:
            checks.append(Check(name, Status.PASS, f"{chosen.digest}: carries this release's agent, files match"
                                f" their pinned digests; the scrub VM of {whose} boots it"))  # fmt: skip
    return checks, facts


def _opt(value: int | None) -> str:
    return "-" if value is None else str(value)
