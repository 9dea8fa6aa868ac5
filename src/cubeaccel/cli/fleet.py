"""`cubeaccel fleet simulate`: N simulated Cubelets against a CubeMaster (src/cubeaccel/fleet, docs/master.md)."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Annotated

import typer

from cubeaccel.cli.locate import UP_STATE

app = typer.Typer(no_args_is_help=True, help="A simulated fleet of nodes, for CubeMaster's tests and benchmarks.")

# Named fault mixes (`--profile`); the explicit options override them.
PROFILES: dict[str, dict[str, float]] = {
    "ideal": {"latency_ms": 0.0, "jitter_ms": 0.0, "error_rate": 0.0},
    "lan": {"latency_ms": 1.0, "jitter_ms": 4.0, "error_rate": 0.0},
    "flaky": {"latency_ms": 2.0, "jitter_ms": 20.0, "error_rate": 0.05},
}


@app.command("simulate")
def simulate_cmd(
    master: Annotated[list[str], typer.Option(help="a CubeMaster URL (repeat for replicas)")],
    nodes: Annotated[int, typer.Option(min=1, max=1_000_000, help="simulated nodes")] = 100,
    devices_per_node: Annotated[int, typer.Option(min=1, max=64, help="GPUs per node")] = 8,
    profile: Annotated[str, typer.Option(help="fault mix: " + " | ".join(PROFILES))] = "ideal",
    latency_ms: Annotated[float | None, typer.Option(min=0.0, help="added to every answer")] = None,
    jitter_ms: Annotated[float | None, typer.Option(min=0.0, help="random extra latency, up to this")] = None,
    error_rate: Annotated[float | None, typer.Option(min=0.0, max=1.0, help="share of reservations refused")] = None,
    period: Annotated[float, typer.Option(min=0.05, help="heartbeat period, seconds (the Cubelet's tick)")] = 2.0,
    port: Annotated[int, typer.Option(min=0, max=65535, help="the nodes' API port on 127.0.0.0/8 (0: any)")] = 0,
    admin_key_file: Annotated[Path, typer.Option(help="a CubeMaster admin key: enrols the nodes")] = UP_STATE
    / "admin.key",
    report_every: Annotated[float, typer.Option(min=0.5, help="seconds between JSON reports on stdout")] = 10.0,
) -> None:
    """Enrol N nodes at CubeMaster, heartbeat for each at the production period and answer the Cubelet API on a
    loopback address per node, until interrupted; prints the fleet's report (JSON) every `report_every`."""
    from cubeaccel.fleet.api import Faults
    from cubeaccel.fleet.sim import Fleet

    if profile not in PROFILES:
        raise typer.BadParameter(f"unknown profile {profile!r}; one of {', '.join(PROFILES)}")
    p = PROFILES[profile]
    faults = Faults(
        latency_s=(p["latency_ms"] if latency_ms is None else latency_ms) / 1000,
        jitter_s=(p["jitter_ms"] if jitter_ms is None else jitter_ms) / 1000,
        error_rate=p["error_rate"] if error_rate is None else error_rate,
    )
    try:
        admin = admin_key_file.read_text().strip()
    except OSError as e:
        raise typer.BadParameter(f"{admin_key_file}: {e}") from e
    fleet = Fleet(master, admin, nodes, devices_per_node, faults, period_s=period, port=port)
    fleet.start()
    typer.echo(json.dumps({"listening": f"127.0.0.0/8:{fleet.port}", "nodes": nodes, "prefix": fleet.prefix}))
    stop = threading.Event()
    try:
        while not stop.wait(report_every):
            typer.echo(json.dumps(fleet.report()))
    except KeyboardInterrupt:
        pass
    finally:
        fleet.stop()
        typer.echo(json.dumps(fleet.report()))
