"""`cubeaccel master serve|register|backup|restore`: CubeMaster's own process and its database."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated

import typer

from cubeaccel.cli import output
from cubeaccel.cli.master_access import (
    MasterUrl,
    call_master,
    fail,
    write_secret,
)
from cubeaccel.cli.render import console
from cubeaccel.protocol.errors import CubeError

app = typer.Typer(no_args_is_help=True, help="CubeMaster: cluster placement, templates and sandbox records.")

DEFAULT_STATE = Path(os.environ.get("CUBEACCEL_MASTER_STATE_DIR", Path.home() / ".local/state/cubeaccel/master"))


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

    from cubeaccel.transport.telemetry import configure_logging

    configure_logging(log_level)  # None: $CUBEACCEL_LOG_LEVEL, else info

    from cubeaccel.master.maintenance import Maintenance
    from cubeaccel.master.server import create_app
    from cubeaccel.master.service import CubeMaster, MasterConfig
    from cubeaccel.master.store import MasterStore
    from cubeaccel.transport.http_server import run_servers, server_config

    host, port = _listen(listen)
    from cubeaccel.host.service import statelock
    from cubeaccel.host.service.private import private_umask

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

        from cubeaccel.host.service import sdnotify

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
    output.emit(call_master(url, lambda c: c.register_template(doc, default)))


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
    from cubeaccel.host.service.backup import backup

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
    from cubeaccel.host.service.backup import restore

    try:
        info = restore(backup_dir, state_dir, "master")
    except CubeError as e:
        fail(e)
    output.emit(info, lambda: console.print(f"restored {backup_dir} into {state_dir}: start `cubeaccel master serve`"))
