"""`cubeaccel master serve`, `cubeaccel sandbox …`, `cubeaccel nodes`, `cubeaccel up` / `down`."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.table import Table

from cubeaccel.cli import output
from cubeaccel.cli.locate import UP_STATE, up_info
from cubeaccel.cli.render import console
from cubeaccel.model.errors import CubeError
from cubeaccel.wire.master_client import MasterClient

app = typer.Typer(no_args_is_help=True, help="CubeMaster: cluster placement, templates and sandbox records.")
sandbox_app = typer.Typer(no_args_is_help=True, help="Sandboxes through CubeMaster.")

DEFAULT_STATE = Path(os.environ.get("CUBEACCEL_MASTER_STATE_DIR", Path.home() / ".local/state/cubeaccel/master"))
MasterUrl = Annotated[
    str | None,
    typer.Option("--master", help="CubeMaster URL (default: $CUBEACCEL_MASTER, then the one `cubeaccel up` started)"),
]
AsJson = Annotated[bool, typer.Option("--json", help="same as -o json")]


def write_secret(path: Path, value: str) -> None:
    """A key file, 0600 from its first byte (never readable by others, even briefly)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")


def api_key() -> str | None:
    """$CUBEACCEL_API_KEY, else $CUBEACCEL_API_KEY_FILE's, else the admin key `cubeaccel up` wrote."""
    if os.environ.get("CUBEACCEL_API_KEY"):
        return os.environ["CUBEACCEL_API_KEY"]
    if os.environ.get("CUBEACCEL_API_KEY_FILE"):
        return Path(os.environ["CUBEACCEL_API_KEY_FILE"]).read_text().strip()
    for path in (UP_STATE / "admin.key",):
        if path.exists():
            return path.read_text().strip()
    return None


def master_url(explicit: str | None) -> str:
    if explicit:
        return explicit
    if os.environ.get("CUBEACCEL_MASTER"):
        return os.environ["CUBEACCEL_MASTER"]
    up = up_info()
    if up is not None and up.get("master_url"):
        return str(up["master_url"])
    return "http://127.0.0.1:7700"


def fail(e: CubeError, exit_code: int = 1) -> NoReturn:
    output.fail(e, exit_code)


MASTER_FIX = "is it running? start one with `cubeaccel up`, or pass --master URL / set $CUBEACCEL_MASTER"


def _call(url: str | None, fn: Any) -> Any:
    client = MasterClient(master_url(url), key=api_key())
    try:
        with output.reaching("CubeMaster", client.url, MASTER_FIX):
            return fn(client)
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
    default_timeout: Annotated[
        float, typer.Option(min=1.0, help="lifetime of a sandbox created without a timeout, seconds")
    ] = 3600.0,
    cubelet_timeout: Annotated[
        float,
        typer.Option(
            min=1.0,
            help="seconds one request to a Cubelet may take; a placement untouched for twice this long belongs "
            "to a create that died and is settled by maintenance",
        ),
    ] = 30.0,
    log_level: Annotated[str | None, typer.Option(help="JSON logs on stderr: debug|info|warning|error")] = None,
) -> None:
    """Run CubeMaster: migrate the database, then serve the API."""
    import uvicorn

    from cubeaccel.wire.telemetry import configure_logging

    configure_logging(log_level)  # None: $CUBEACCEL_LOG_LEVEL, else info

    from cubeaccel.master.maintenance import Maintenance
    from cubeaccel.master.server import create_app
    from cubeaccel.master.service import CubeMaster, MasterConfig
    from cubeaccel.master.store import MasterStore
    from cubeaccel.wire.http_server import run_servers, server_config

    host, port = _listen(listen)
    from cubeaccel.host import statelock
    from cubeaccel.host.private import private_umask

    private_umask()  # master.db (every tenant's records) is owner-only whatever the state dir allows
    try:
        lock = statelock.acquire(state_dir, "master")  # held until exit: one CubeMaster per state dir
    except CubeError as e:
        fail(e, statelock.LOCKED_EXIT)
    if staleness <= 0 or tick <= 0:
        raise typer.BadParameter("staleness and tick must be > 0")
    url = db or str(state_dir / "master.db")
    try:
        store = MasterStore(url)
    except CubeError as e:
        fail(e)
        return
    config = MasterConfig(staleness_s=staleness, default_lifetime_s=default_timeout, cubelet_timeout_s=cubelet_timeout)
    master = CubeMaster(store, config)
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
        import asyncio

        from cubeaccel.host import sdnotify

        app = create_app(master, maintenance, audit=audit_log or state_dir / "audit.jsonl")
        server = uvicorn.Server(server_config(app, host=host, port=port))

        async def run() -> None:  # uvicorn's own run(), plus READY=1 for systemd once it listens
            await asyncio.gather(server.serve(), sdnotify.when_started([server], f"CubeMaster on {host}:{port}"))

        run_servers(run(), server.config)
    finally:
        maintenance.stop()
        lock.release()


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
        fail(e)
    output.emit(_call(url, lambda c: c.register_template(doc, default)))


def nodes_cmd(url: MasterUrl = None, as_json: AsJson = False) -> None:
    """Nodes, their state (ready / draining / stale) and free devices."""
    output.json_flag(as_json)
    nodes = _call(url, lambda c: c.nodes())
    output.emit({"nodes": nodes}, lambda: console.print(_nodes_table(nodes)))


def _nodes_table(nodes: list[dict[str, Any]]) -> Table:
    t = Table(title="nodes")
    for col in ("node", "state", "heartbeat", "backends", "free/total", "devices", "warm"):
        t.add_column(col)
    for n in nodes:
        groups = ", ".join(
            f"{g['labels'].get('model', g['class'])} {g['allocatable']}/{g['total']}" for g in n["groups"]
        )
        t.add_row(
            n["node"],
            output.state(n["state"]),
            f"{n['last_heartbeat_age_s']:.1f}s ago",
            ",".join(n["backends"]),
            f"{n['allocatable']}/{n['total']}",
            groups,
            _warm_cell(n.get("warm_pools") or []),
        )
    return t


def _warm_cell(pools: list[dict[str, Any]]) -> str:
    """Per pool: warm/size, and how many are starting (refill)."""
    cells = []
    for p in pools:
        starting = f" +{p['starting']} starting" if p["starting"] else ""
        cells.append(f"{p['template'] or p['key']} {p['warm']}/{p['size']} warm{starting}")
    return ", ".join(cells) or "-"


node_app = typer.Typer(no_args_is_help=True, help="Nodes through CubeMaster: list, drain, undrain (admin key).")


@node_app.command("list")
def node_list(url: MasterUrl = None, as_json: AsJson = False) -> None:
    """The same as `cubeaccel nodes`."""
    nodes_cmd(url, as_json)


def _node_verb(verb: str, node: str, who: str | None, reason: str, url: str | None) -> None:
    r = _call(url, lambda c: c.node_verb(node, verb, who or "operator", reason))
    # `who` in the reply is the authenticated identity CubeMaster recorded, not what was claimed.
    output.emit(r, lambda: console.print(f"node {node}: {r.get('state', verb)} (by {r.get('who', who)}: {reason})"))


@node_app.command("drain")
def node_drain(
    node: str,
    reason: Annotated[str, typer.Option(help="why (audited)")],
    who: Annotated[str | None, typer.Option(help="operator name (CubeMaster records the key's identity)")] = None,
    url: MasterUrl = None,
) -> None:
    """Stop placing new sandboxes on NODE; the ones running there keep running."""
    _node_verb("drain", node, who, reason, url)


@node_app.command("undrain")
def node_undrain(
    node: str,
    reason: Annotated[str, typer.Option(help="why (audited)")],
    who: Annotated[str | None, typer.Option(help="operator name (CubeMaster records the key's identity)")] = None,
    url: MasterUrl = None,
) -> None:
    """Place sandboxes on NODE again."""
    _node_verb("undrain", node, who, reason, url)


NODE_PHASES_GRACE_S = 2.0


def _node_phases(client: MasterClient, sid: str) -> list[dict[str, Any]]:
    try:
        return list(client.sandbox_events(sid)["phases"])
    except CubeError:
        return []  # the node's phases are a nicety; CubeMaster's state decides


def _wait_running(url: str | None, s: dict[str, Any], quiet: bool, timeout_s: float) -> dict[str, Any]:
    """Poll CubeMaster until running or failed, printing each phase once as it appears: CubeMaster's own
    (its timeline) and the node's (VM up … guest validated, `GET /v1/sandboxes/{id}/events`: CubeMaster
    fetches them with the node token; the CLI has none)."""
    import time

    sid, t0 = str(s["id"]), time.time()
    deadline = time.monotonic() + timeout_s
    shown: set[tuple[str, float]] = set()

    def show(phases: list[tuple[float, str]]) -> None:
        for at, what in sorted(phases):
            if (what, at) not in shown:
                shown.add((what, at))
                if not quiet:
                    console.print(f"  {max(0.0, at - t0):7.2f}s  {what}")

    node_grace: float | None = None  # a node's journal may trail CubeMaster's state by a moment
    while True:
        s = _call(url, lambda c: c.sandbox(sid))
        phases = [(float(e["at"]), str(e["phase"])) for e in s.get("timeline", [])]
        node_phases: list[tuple[float, str]] = []
        if s.get("node"):
            node_phases = [(float(p["at"]), str(p["phase"])) for p in _call(url, lambda c: _node_phases(c, sid))]
        show(phases + node_phases)
        done = s.get("state") in ("running", "failed", "deleted")
        if done and s.get("node") and not node_phases:
            node_grace = node_grace or time.monotonic() + NODE_PHASES_GRACE_S
            done = time.monotonic() > node_grace
        if done or time.monotonic() > deadline:
            if s.get("state") == "failed" and not quiet:
                err = s.get("error") or {}
                console.print(f"[red]failed[/red] {err.get('code')} (layer {err.get('layer')}): {err.get('message')}")
            return s
        time.sleep(0.2)


def _sandbox_table(rows: list[dict[str, Any]]) -> Table:
    t = Table(title="sandboxes")
    t.add_column("id", no_wrap=True)
    for col in ("state", "node", "template", "devices", "error"):
        t.add_column(col, overflow="fold")
    for s in rows:
        tpl = s["template"] or {}
        tpl = "@".join(x for x in (tpl.get("name"), tpl.get("version")) if x) or "-"
        err = (s["error"] or {}).get("code", "")
        t.add_row(s["id"], output.state(s["state"]), s["node"] or "-", tpl, ", ".join(s["device_ids"]) or "-", err)
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
    wait: Annotated[
        bool, typer.Option("--wait/--no-wait", help="return once running (or failed), phases shown")
    ] = True,
    wait_timeout: Annotated[float, typer.Option(help="seconds --wait waits")] = 600.0,
    url: MasterUrl = None,
    as_json: AsJson = False,
) -> None:
    """Create a sandbox and wait until it runs (phases shown live); on refusal or failure, print why."""
    as_json = as_json or output.machine()
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
    token = s.get("access_token")
    if wait:  # even when already running: the phases it went through are shown
        s = _wait_running(url, s, quiet=as_json, timeout_s=wait_timeout)
        s["access_token"] = token
    if as_json:
        print(json.dumps(s, indent=2))
    else:
        console.print(_sandbox_table([s]))
        if s.get("access_token"):  # shown once: only its hash is kept
            console.print(f"access token (for exec/cp; shown once): {s['access_token']}")
    if s.get("state") == "failed":
        raise typer.Exit(1)


@sandbox_app.command("list")
def sandbox_list(
    state: Annotated[str | None, typer.Option()] = None, url: MasterUrl = None, as_json: AsJson = False
) -> None:
    """Sandboxes; with no --state, an admin also sees the nodes' warm sandboxes (state `warm`, no tenant's)."""
    output.json_flag(as_json)
    rows = _call(url, lambda c: c.sandboxes(state) + ([] if state else c.sandboxes("warm")))
    output.emit({"sandboxes": rows}, lambda: console.print(_sandbox_table(rows)))


@sandbox_app.command("show")
def sandbox_show(sandbox_id: str, url: MasterUrl = None) -> None:
    """One sandbox with its per-phase timeline."""
    output.emit(_call(url, lambda c: c.sandbox(sandbox_id)))


@sandbox_app.command("timeout")
def sandbox_timeout(
    sandbox_id: str, seconds: Annotated[float, typer.Argument(help="from now")], url: MasterUrl = None
) -> None:
    """Extend (or shorten) a sandbox's lifetime; at expiry it is deleted through the release path."""
    s = _call(url, lambda c: c.set_timeout(sandbox_id, seconds))
    console.print(f"{sandbox_id} expires at {s['expires_at']:.0f} (in {seconds:.0f} s)")


@sandbox_app.command("delete")
def sandbox_delete(sandbox_id: str, url: MasterUrl = None) -> None:
    s = _call(url, lambda c: c.delete(sandbox_id))
    output.emit(s, lambda: console.print(_sandbox_table([s])))


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


tenant_app = typer.Typer(no_args_is_help=True, help="Tenants (admin key): each gets an API key, shown once.")
key_app = typer.Typer(
    no_args_is_help=True,
    help="API keys. A tenant rotates its own: `key create --out NEW`, switch clients to NEW, `key revoke OLD_ID`.",
)
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
    output.emit(_call(url, lambda c: c.request("GET", "/v1/tenants"))["tenants"])


@tenant_app.command("revoke")
def tenant_revoke(name: str, url: MasterUrl = None) -> None:
    """Revoke a tenant and every key it has."""
    print(json.dumps(_call(url, lambda c: c.request("DELETE", f"/v1/tenants/{name}"))))


@key_app.command("create")
def key_create(
    tenant: Annotated[
        str | None, typer.Option(help="admin: a key for this tenant; without it a key like the caller's own")
    ] = None,
    admin: Annotated[bool, typer.Option("--admin", help="admin: a new admin key")] = False,
    out: Annotated[Path | None, typer.Option(help="write the key here (0600) instead of printing it")] = None,
    url: MasterUrl = None,
) -> None:
    """A new key, shown once. Without --tenant/--admin: another key for the calling key's own tenant (or
    admin role), both working until the old one is revoked."""
    path = f"/v1/tenants/{tenant}/keys" if tenant else "/v1/admin-keys" if admin else "/v1/keys"
    r = _call(url, lambda c: c.request("POST", path))
    if out is not None:
        write_secret(out, r.pop("key"))
        r["written_to"] = str(out)
    print(json.dumps(r, indent=2))


@key_app.command("list")
def key_list(url: MasterUrl = None) -> None:
    """Live keys (ids only): a tenant's own, or (admin) every key."""
    output.emit(_call(url, lambda c: c.request("GET", "/v1/keys"))["keys"])


@key_app.command("revoke")
def key_revoke(key_id: str, url: MasterUrl = None) -> None:
    """Revoke a key by id (a tenant: only its own)."""
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
    head: Annotated[Path | None, typer.Option(help="--verify: the sealed head file (default FILE.head)")] = None,
    master_seal: Annotated[
        bool, typer.Option(help="--verify: also against the head CubeMaster sealed in its database (admin key)")
    ] = False,
    device: Annotated[
        str | None, typer.Option(help="a Cubelet's log: which tenant and sandbox held this device (--at)")
    ] = None,
    at: Annotated[str | None, typer.Option(help="--device: unix time or ISO 8601 (default: now)")] = None,
    url: MasterUrl = None,
) -> None:
    """Query (or verify) an audit log (CubeMaster's or a Cubelet's), a local file of hash-chained JSON lines.
    --verify finds edited, removed or reordered lines, and a cut-off tail against the sealed head. --device ID
    (on a Cubelet's log, `--file STATE_DIR/audit.jsonl`) answers who held the device at --at, with the trail."""
    from cubeaccel.host.audit import log_id, read
    from cubeaccel.host.audit import verify as check

    if not path.exists():
        console.print(f"[red]error[/red] no audit log at {path}")
        raise typer.Exit(1)
    if device is not None:
        from cubeaccel.model.audit_trail import holding_at

        answer = holding_at(read(path), device, _when(at))
        print(json.dumps(answer, sort_keys=True))
        raise typer.Exit(0 if answer["holder"] or answer["previous"] else 1)
    if verify:
        seals: list[dict[str, Any]] = []
        if master_seal:
            lid = log_id(path) or ""
            held = _call(url, lambda c: c.request("GET", "/v1/audit/seals"))["seals"]
            seals = [s for s in held if lid.startswith(s["log"])]
            if not seals:
                print("CubeMaster holds no seal for this log")
                raise typer.Exit(1)
        problems = check(path, head, seals)
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


def _when(at: str | None) -> float:
    """Unix seconds, or ISO 8601 (a time without an offset is the local time)."""
    import time
    from datetime import datetime

    if at is None:
        return time.time()
    try:
        return float(at)
    except ValueError:
        pass
    try:
        return datetime.fromisoformat(at).timestamp()
    except ValueError as e:
        raise typer.BadParameter(f"--at wants unix seconds or ISO 8601, got {at!r}") from e


def register_top_level(root: typer.Typer) -> None:
    root.add_typer(tenant_app, name="tenant")
    root.add_typer(key_app, name="key")
    root.add_typer(node_cred_app, name="node-credential")
    root.command("audit")(audit_cmd)
    root.command("nodes")(nodes_cmd)
    root.add_typer(node_app, name="node")
    root.command("up")(up_cmd)
    root.command("down")(down_cmd)
    root.add_typer(sandbox_app, name="sandbox")


# ---- workloads: exec and cp, through the sandbox's node (Cubelet's proxy) ------------------------------------------
TokenOpt = Annotated[
    str | None,
    typer.Option(
        "--token", help="the sandbox's access token (from `sandbox create`; default $CUBEACCEL_SANDBOX_TOKEN)"
    ),
]


def _workload(sandbox_id: str, url: str | None, token: str | None, timeout: float | None = None) -> Any:
    """A workload client for the sandbox, at its node's Cubelet proxy: CubeMaster names it to the sandbox's own
    tenant (`GET /v1/sandboxes/{id}/workload`), so a tenant key is enough."""
    from cubeaccel.wire.workload_client import WorkloadClient

    token = token or os.environ.get("CUBEACCEL_SANDBOX_TOKEN")
    if not token:
        fail(CubeError("workload.unauthenticated", "no access token: --token or $CUBEACCEL_SANDBOX_TOKEN", "api"))
    endpoint = _call(url, lambda c: c.workload_endpoint(sandbox_id))
    return WorkloadClient.over(endpoint.url, str(token), timeout=timeout)


def _env_pairs(values: list[str]) -> dict[str, str]:
    out = {}
    for v in values:
        k, sep, val = v.partition("=")
        if not sep or not k:
            raise typer.BadParameter(f"--env wants K=V, got {v!r}")
        out[k] = val
    return out


@sandbox_app.command("exec", context_settings={"allow_interspersed_args": False})
def sandbox_exec(
    sandbox_id: Annotated[str, typer.Argument(help="sandbox id")],
    cmd: Annotated[list[str], typer.Argument(help="the command and its arguments (after --)")],
    env: Annotated[list[str], typer.Option("--env", help="K=V, repeatable")] = [],  # noqa: B006 - typer reads it
    cwd: Annotated[str | None, typer.Option(help="working directory in the guest")] = None,
    user: Annotated[str | None, typer.Option(help="guest user (default: user)")] = None,
    timeout: Annotated[float | None, typer.Option(help="seconds before the command's group is SIGKILLed")] = None,
    no_stdin: Annotated[bool, typer.Option("--no-stdin", help="do not pass this process's stdin")] = False,
    token: TokenOpt = None,
    url: MasterUrl = None,
) -> None:
    """Run CMD in the sandbox: stdout/stderr stream live, stdin is passed, the exit code is the command's."""
    import sys

    if cmd and cmd[0] == "--":  # kept by click when interspersed options are off
        cmd = cmd[1:]
    if not cmd:
        raise typer.BadParameter("no command after --")
    wl = _workload(sandbox_id, url, token)

    def out(b: bytes) -> None:
        sys.stdout.buffer.write(b)
        sys.stdout.buffer.flush()

    def err(b: bytes) -> None:
        sys.stderr.buffer.write(b)
        sys.stderr.buffer.flush()

    try:
        result = wl.exec(
            cmd,
            envs=_env_pairs(env),
            cwd=cwd,
            user=user,
            timeout_s=timeout,
            stdin=None if no_stdin or sys.stdin is None or sys.stdin.isatty() else sys.stdin.buffer,
            on_stdout=out,
            on_stderr=err,
        )
    except CubeError as e:
        fail(e)
    except OSError as e:
        console.print(f"[red]error[/red] cannot reach the sandbox's node: {e}")
        raise typer.Exit(1) from e
    finally:
        wl.close()
    raise typer.Exit(result.exit_code)


def _remote(arg: str) -> tuple[str, str] | None:
    """`SB:/path` → (SB, /path); a local path (no colon before the first slash) → None."""
    head, sep, path = arg.partition(":")
    if not sep or "/" in head or not head or not path:
        return None
    return head, path


@sandbox_app.command("cp")
def sandbox_cp(
    src: Annotated[str, typer.Argument(help="local path or SB:/path")],
    dst: Annotated[str, typer.Argument(help="local path or SB:/path")],
    user: Annotated[str | None, typer.Option(help="guest user owning what is written (default: user)")] = None,
    token: TokenOpt = None,
    url: MasterUrl = None,
) -> None:
    """Copy one file into or out of a sandbox (streamed; parents are created in the guest)."""
    rs, rd = _remote(src), _remote(dst)
    if (rs is None) == (rd is None):
        raise typer.BadParameter("exactly one of SRC and DST is SB:/path")
    remote = rs or rd
    assert remote is not None
    wl = _workload(remote[0], url, token)
    try:
        if rd is not None:
            with open(src, "rb") as f:
                wl.upload(rd[1], f, user=user)
        else:
            assert rs is not None
            target = Path(dst)
            if target.is_dir():
                target = target / Path(rs[1]).name
            with open(target, "wb") as f:
                wl.download(rs[1], f, user=user)
    except CubeError as e:
        fail(e)
    except OSError as e:
        console.print(f"[red]error[/red] {e}")
        raise typer.Exit(1) from e
    finally:
        wl.close()


# ---- backup and restore (SQLite; PostgreSQL uses pg_dump, docs/service.md) ------------------------------------------
def _sqlite_path(db: str | None, state_dir: Path) -> Path:
    if db is None:
        return state_dir / "master.db"
    if db.startswith("postgresql"):
        fail(
            CubeError(
                "backup.failed",
                "a PostgreSQL database is backed up with pg_dump (docs/service.md), not by this command",
                "api",
                {"db": db.split("@")[-1]},
            )
        )
    return Path(db.removeprefix("sqlite:///"))


@app.command("backup")
def backup_cmd(
    out: Annotated[Path, typer.Argument(help="a new directory for the backup")],
    state_dir: Annotated[Path, typer.Option(help="CubeMaster's state directory")] = DEFAULT_STATE,
    db: Annotated[str | None, typer.Option(help="sqlite:///PATH (default: STATE_DIR/master.db)")] = None,
) -> None:
    """Back up a (running) CubeMaster's SQLite database with the online backup API, plus its audit log."""
    from cubeaccel.host.backup import backup

    try:
        info = backup(_sqlite_path(db, state_dir), [state_dir / "audit.jsonl"], out, "master")
    except CubeError as e:
        fail(e)
    output.emit(info, lambda: console.print(f"backed up CubeMaster to {out} ({sum(info['rows'].values())} rows)"))


@app.command("restore")
def restore_cmd(
    backup_dir: Annotated[Path, typer.Argument(help="a directory written by `cubeaccel master backup`")],
    state_dir: Annotated[Path, typer.Option(help="a fresh state directory")] = DEFAULT_STATE,
) -> None:
    """Restore a backup into a fresh state directory (refused where a database exists or a CubeMaster runs)."""
    from cubeaccel.host.backup import restore

    try:
        info = restore(backup_dir, state_dir, "master")
    except CubeError as e:
        fail(e)
    output.emit(info, lambda: console.print(f"restored {backup_dir} into {state_dir}: start `cubeaccel master serve`"))
