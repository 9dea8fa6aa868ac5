"""`cubeaccel master serve`, `cubeaccel sandbox …`, `cubeaccel nodes`, `cubeaccel up` / `down`."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from cubeaccel.cli.render import console
from cubeaccel.model.errors import CubeError
from cubeaccel.wire.master_client import MasterClient

app = typer.Typer(no_args_is_help=True, help="CubeMaster: cluster placement, templates and sandbox records.")
sandbox_app = typer.Typer(no_args_is_help=True, help="Sandboxes through CubeMaster.")

DEFAULT_STATE = Path(os.environ.get("CUBEACCEL_MASTER_STATE_DIR", Path.home() / ".local/state/cubeaccel/master"))
UP_STATE = Path(os.environ.get("CUBEACCEL_UP_STATE_DIR", Path.home() / ".local/state/cubeaccel/up"))
MasterUrl = Annotated[
    str | None,
    typer.Option("--master", help="CubeMaster URL (default: $CUBEACCEL_MASTER, then the one `cubeaccel up` started)"),
]
AsJson = Annotated[bool, typer.Option("--json")]


def master_url(explicit: str | None) -> str:
    if explicit:
        return explicit
    if os.environ.get("CUBEACCEL_MASTER"):
        return os.environ["CUBEACCEL_MASTER"]
    up = UP_STATE / "up.json"
    if up.exists():
        return str(json.loads(up.read_text())["master_url"])
    return "http://127.0.0.1:7700"


def fail(e: CubeError) -> None:
    console.print(f"[red]error[/red] {e.code} (layer {e.layer}): {e.message}")
    if e.details:
        console.print_json(json.dumps(e.details, default=str))
    raise typer.Exit(1)


def _call(url: str | None, fn: Any) -> Any:
    client = MasterClient(master_url(url))
    try:
        return fn(client)
    except CubeError as e:
        fail(e)
    except OSError as e:
        console.print(f"[red]error[/red] cannot reach CubeMaster at {client.url}: {e}")
        raise typer.Exit(1) from e
    finally:
        client.close()


def _listen(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise typer.BadParameter(f"expected HOST:PORT, got {value!r}")
    return host, int(port)


@app.command("serve")
def serve_cmd(
    db: Annotated[
        str | None, typer.Option(help="sqlite:///PATH (default: STATE_DIR/master.db) or postgresql://…")
    ] = None,
    listen: Annotated[str, typer.Option(help="HOST:PORT")] = "127.0.0.1:7700",
    state_dir: Annotated[Path, typer.Option(help="where the default SQLite database lives")] = DEFAULT_STATE,
    staleness: Annotated[float, typer.Option(help="seconds without a heartbeat before a node is stale")] = 10.0,
    tick: Annotated[float, typer.Option(help="seconds between maintenance passes")] = 1.0,
) -> None:
    """Run CubeMaster: migrate the database, then serve the API."""
    import uvicorn

    from cubeaccel.master.maintenance import Maintenance
    from cubeaccel.master.server import create_app
    from cubeaccel.master.service import CubeMaster, MasterConfig
    from cubeaccel.master.store import MasterStore
    from cubeaccel.wire.http_server import server_config

    host, port = _listen(listen)
    from cubeaccel.host.private import private_umask

    private_umask()  # master.db (every tenant's records) is owner-only whatever the state dir allows
    if staleness <= 0 or tick <= 0:
        raise typer.BadParameter("staleness and tick must be > 0")
    url = db or str(state_dir / "master.db")
    try:
        store = MasterStore(url)
    except CubeError as e:
        fail(e)
        return
    master = CubeMaster(store, MasterConfig(staleness_s=staleness))
    maintenance = Maintenance(master, tick)
    maintenance.start()
    print(
        json.dumps(
            {
                "cubemaster": "ready",
                "url": f"http://{host}:{port}",
                "db": store.dialect,
                "schema_version": store.schema_version,
                "pid": os.getpid(),
            }
        ),
        flush=True,
    )
    try:
        uvicorn.Server(server_config(create_app(master, maintenance), host=host, port=port)).run()
    finally:
        maintenance.stop()


@app.command("register")
def register_cmd(
    path: Annotated[Path, typer.Argument(help="template YAML/JSON")],
    default: Annotated[bool, typer.Option(help="make it its class's default")] = False,
    url: MasterUrl = None,
) -> None:
    """Register a template (checked at registration; the refusal names the layer)."""
    from cubeaccel.wire.templates import load_document

    try:
        doc = load_document(path)
    except CubeError as e:
        console.print(f"[red]error[/red] cannot read {path}: {e.message}")
        raise typer.Exit(1) from e
    console.print_json(json.dumps(_call(url, lambda c: c.register_template(doc, default))))


def nodes_cmd(url: MasterUrl = None, as_json: AsJson = False) -> None:
    """Nodes, their state (ready / draining / stale) and free devices."""
    nodes = _call(url, lambda c: c.nodes())
    if as_json:
        print(json.dumps({"nodes": nodes}, indent=2))
        return
    t = Table(title="nodes")
    for col in ("node", "state", "heartbeat", "backends", "free/total", "devices"):
        t.add_column(col)
    for n in nodes:
        groups = ", ".join(
            f"{g['labels'].get('model', g['class'])} {g['allocatable']}/{g['total']}" for g in n["groups"]
        )
        t.add_row(
            n["node"],
            n["state"],
            f"{n['last_heartbeat_age_s']:.1f}s ago",
            ",".join(n["backends"]),
            f"{n['allocatable']}/{n['total']}",
            groups,
        )
    console.print(t)


def _sandbox_table(rows: list[dict[str, Any]]) -> Table:
    t = Table(title="sandboxes")
    for col in ("id", "state", "node", "template", "devices", "error"):
        t.add_column(col)
    for s in rows:
        tpl = s["template"]["name"] + "@" + s["template"]["version"] if s["template"] else "-"
        err = (s["error"] or {}).get("code", "")
        t.add_row(s["id"], s["state"], s["node"] or "-", tpl, ", ".join(s["device_ids"]) or "-", err)
    return t


@sandbox_app.command("create")
def sandbox_create(
    gpu: Annotated[str | None, typer.Option(help="shorthand MODEL[:COUNT], e.g. H100:1")] = None,
    template: Annotated[str | None, typer.Option(help="template name (or name@version)")] = None,
    accel_class: Annotated[str | None, typer.Option("--class", help="accelerator class (instead of --gpu)")] = None,
    count: Annotated[int, typer.Option(help="with --class")] = 1,
    selector: Annotated[
        str | None, typer.Option(help="CEL over device labels, e.g. 'int(device.memory_gib) >= 80'")
    ] = None,
    sandbox_id: Annotated[str | None, typer.Option("--id")] = None,
    memory_mib: Annotated[int | None, typer.Option()] = None,
    timeout: Annotated[float | None, typer.Option(help="seconds until CubeMaster deletes it")] = None,
    tenant: Annotated[str, typer.Option()] = "default",
    url: MasterUrl = None,
    as_json: AsJson = False,
) -> None:
    """Create a sandbox; on refusal, print why per node."""
    body: dict[str, Any] = {"tenant": tenant}
    if gpu:
        body["gpu"] = gpu
    if accel_class or selector:
        entry: dict[str, Any] = {"class": accel_class or "gpu", "count": count}
        if selector:
            entry["selector"] = selector
        body["accelerators"] = [entry]
    for k, v in (("template", template), ("id", sandbox_id), ("memory_mib", memory_mib), ("timeout_s", timeout)):
        if v is not None:
            body[k] = v
    s = _call(url, lambda c: c.create(body))
    if as_json:
        print(json.dumps(s, indent=2))
    else:
        console.print(_sandbox_table([s]))


@sandbox_app.command("list")
def sandbox_list(
    state: Annotated[str | None, typer.Option()] = None, url: MasterUrl = None, as_json: AsJson = False
) -> None:
    rows = _call(url, lambda c: c.sandboxes(state))
    if as_json:
        print(json.dumps({"sandboxes": rows}, indent=2))
    else:
        console.print(_sandbox_table(rows))


@sandbox_app.command("show")
def sandbox_show(sandbox_id: str, url: MasterUrl = None) -> None:
    """One sandbox with its per-phase timeline."""
    print(json.dumps(_call(url, lambda c: c.sandbox(sandbox_id)), indent=2))


@sandbox_app.command("delete")
def sandbox_delete(sandbox_id: str, url: MasterUrl = None) -> None:
    s = _call(url, lambda c: c.delete(sandbox_id))
    console.print(_sandbox_table([s]))


def up_cmd(
    state_dir: Annotated[Path, typer.Option(help="master database, Cubelet state, logs")] = UP_STATE,
    backend: Annotated[str, typer.Option(help="auto | simulated | emulated")] = "auto",
    profile: Annotated[str, typer.Option(help="simulated devices")] = "h100x2",
    detach: Annotated[bool, typer.Option(help="return once the node is ready; stop with `cubeaccel down`")] = False,
) -> None:
    """Embedded single node: CubeMaster (SQLite) + one Cubelet, with the best backend this host supports."""
    from cubeaccel.master.up import run_up

    raise typer.Exit(run_up(state_dir, backend, profile, detach))


def down_cmd(state_dir: Annotated[Path, typer.Option()] = UP_STATE) -> None:
    """Stop what `cubeaccel up --detach` started."""
    from cubeaccel.master.up import run_down

    raise typer.Exit(run_down(state_dir))


def register_top_level(root: typer.Typer) -> None:
    root.command("nodes")(nodes_cmd)
    root.command("up")(up_cmd)
    root.command("down")(down_cmd)
    root.add_typer(sandbox_app, name="sandbox")
