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


def write_secret(path: Path, value: str) -> None:
    """A key file, 0600 from its first byte (never readable by others, even briefly)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")


def api_key() -> str | None:
    """$CUBEACCEL_API_KEY, else the admin key `cubeaccel up` wrote into its state dir."""
    if os.environ.get("CUBEACCEL_API_KEY"):
        return os.environ["CUBEACCEL_API_KEY"]
    for path in (UP_STATE / "admin.key",):
        if path.exists():
            return path.read_text().strip()
    return None


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
    client = MasterClient(master_url(url), key=api_key())
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
    audit_log: Annotated[Path | None, typer.Option(help="audit log (default: STATE_DIR/audit.jsonl)")] = None,
    bootstrap: Annotated[
        Path | None,
        typer.Option(help="first start: write an admin key and the default tenant's key (0600) into this directory"),
    ] = None,
) -> None:
    """Run CubeMaster: migrate the database, then serve the API."""
    import uvicorn

    from cubeaccel.master.maintenance import Maintenance
    from cubeaccel.master.server import create_app
    from cubeaccel.master.service import CubeMaster, MasterConfig
    from cubeaccel.master.store import MasterStore

    host, port = _listen(listen)
    if staleness <= 0 or tick <= 0:
        raise typer.BadParameter("staleness and tick must be > 0")
    url = db or str(state_dir / "master.db")
    try:
        store = MasterStore(url)
    except CubeError as e:
        fail(e)
        return
    master = CubeMaster(store, MasterConfig(staleness_s=staleness))
    if bootstrap is not None:
        from cubeaccel.master.auth import bootstrap as make_keys

        keys = make_keys(master.auth)
        for name, key in (keys or {}).items():
            write_secret(bootstrap / f"{name}.key", key)
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
        app = create_app(master, maintenance, audit=audit_log or state_dir / "audit.jsonl")
        uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False)
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


tenant_app = typer.Typer(no_args_is_help=True, help="Tenants (admin key): each gets an API key, shown once.")
key_app = typer.Typer(no_args_is_help=True, help="API keys (admin key).")
node_cred_app = typer.Typer(no_args_is_help=True, help="Node credentials (admin key).")


@tenant_app.command("create")
def tenant_create(
    name: str,
    max_sandboxes: Annotated[int | None, typer.Option(min=0)] = None,
    max_accelerators: Annotated[list[str] | None, typer.Option(help="CLASS=N, repeatable")] = None,
    max_pinned_mib: Annotated[int | None, typer.Option(min=0)] = None,
    max_lifetime: Annotated[float | None, typer.Option(help="seconds")] = None,
    default_lifetime: Annotated[float | None, typer.Option(help="seconds")] = None,
    url: MasterUrl = None,
) -> None:
    """Create a tenant and its first key (printed once; store it now)."""
    accels = {}
    for item in max_accelerators or ():
        cls, _, n = item.partition("=")
        if not n.isdigit():
            raise typer.BadParameter(f"expected CLASS=N, got {item!r}")
        accels[cls] = int(n)
    quota = {
        "max_sandboxes": max_sandboxes,
        "max_accelerators": accels,
        "max_pinned_mib": max_pinned_mib,
        "max_lifetime_s": max_lifetime,
        "default_lifetime_s": default_lifetime,
    }
    r = _call(url, lambda c: c.request("POST", "/v1/tenants", {"name": name, "quota": quota}))
    print(json.dumps(r, indent=2))


@tenant_app.command("list")
def tenant_list(url: MasterUrl = None) -> None:
    print(json.dumps(_call(url, lambda c: c.request("GET", "/v1/tenants"))["tenants"], indent=2))


@tenant_app.command("revoke")
def tenant_revoke(name: str, url: MasterUrl = None) -> None:
    """Revoke a tenant and every key it has."""
    print(json.dumps(_call(url, lambda c: c.request("DELETE", f"/v1/tenants/{name}"))))


@key_app.command("create")
def key_create(
    tenant: Annotated[str | None, typer.Option(help="a tenant's key; without it an admin key")] = None,
    url: MasterUrl = None,
) -> None:
    """A new key (printed once)."""
    path = f"/v1/tenants/{tenant}/keys" if tenant else "/v1/admin-keys"
    print(json.dumps(_call(url, lambda c: c.request("POST", path)), indent=2))


@key_app.command("revoke")
def key_revoke(key_id: str, url: MasterUrl = None) -> None:
    print(json.dumps(_call(url, lambda c: c.request("DELETE", f"/v1/keys/{key_id}"))))


@node_cred_app.command("enrol")
def node_enrol(
    node: str,
    out: Annotated[Path, typer.Option(help="write the token here (0600) for the Cubelet's --node-token-file")],
    url: MasterUrl = None,
) -> None:
    """A token for `node` (any earlier one stops working), written 0600, never printed."""
    r = _call(url, lambda c: c.request("POST", f"/v1/nodes/{node}/credential"))
    write_secret(out, r["token"])
    print(f"node {node}: token written to {out}")


@node_cred_app.command("revoke")
def node_revoke(node: str, url: MasterUrl = None) -> None:
    print(json.dumps(_call(url, lambda c: c.request("DELETE", f"/v1/nodes/{node}/credential"))))


def audit_cmd(
    path: Annotated[Path, typer.Option("--file", help="audit log")] = UP_STATE / "audit.jsonl",
    since: Annotated[float | None, typer.Option(help="unix time")] = None,
    tenant: Annotated[str | None, typer.Option()] = None,
    action: Annotated[str | None, typer.Option(help="e.g. sandbox:create, or a prefix: sandbox:")] = None,
    verify: Annotated[bool, typer.Option(help="check the hash chain; exit 1 on any break")] = False,
) -> None:
    """Query (or verify) CubeMaster's audit log, a local file of hash-chained JSON lines."""
    from cubeaccel.host.audit import read
    from cubeaccel.host.audit import verify as check

    if not path.exists():
        console.print(f"[red]error[/red] no audit log at {path}")
        raise typer.Exit(1)
    if verify:
        problems = check(path)
        for p in problems:
            print(p)
        print("audit log intact" if not problems else f"{len(problems)} break(s) in the chain")
        raise typer.Exit(1 if problems else 0)
    for e in read(path):
        if since is not None and e["at"] < since:
            continue
        if tenant is not None and e.get("tenant") != tenant:
            continue
        if action is not None and not str(e["action"]).startswith(action):
            continue
        print(json.dumps(e, sort_keys=True))


def register_top_level(root: typer.Typer) -> None:
    root.add_typer(tenant_app, name="tenant")
    root.add_typer(key_app, name="key")
    root.add_typer(node_cred_app, name="node-credential")
    root.command("audit")(audit_cmd)
    root.command("nodes")(nodes_cmd)
    root.command("up")(up_cmd)
    root.command("down")(down_cmd)
    root.add_typer(sandbox_app, name="sandbox")
