"""`cubeaccel tenant|key|node-credential …` and `cubeaccel audit`: who may call, and what they did."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from cubeaccel.cli import output
from cubeaccel.cli.locate import UP_STATE
from cubeaccel.cli.master_access import (
    MasterUrl,
    call_master,
    write_secret,
)
from cubeaccel.cli.render import console
from cubeaccel.transport.master_client import Calls

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
    r = call_master(url, lambda c: c.call(Calls.create_tenant(name, quota)))
    print(json.dumps(r.model_dump(mode="json"), indent=2))


@tenant_app.command("list")
def tenant_list(url: MasterUrl = None) -> None:
    output.emit(call_master(url, lambda c: c.call(Calls.tenants())).tenants)


@tenant_app.command("revoke")
def tenant_revoke(name: str, url: MasterUrl = None) -> None:
    """Revoke a tenant and every key it has."""
    print(json.dumps(call_master(url, lambda c: c.call(Calls.revoke_tenant(name))).model_dump(mode="json")))


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
    created = call_master(url, lambda c: c.call(Calls.create_key(tenant, admin)))
    r = created.model_dump(mode="json")
    if out is not None:
        write_secret(out, r.pop("key"))
        r["written_to"] = str(out)
    print(json.dumps(r, indent=2))


@key_app.command("list")
def key_list(url: MasterUrl = None) -> None:
    """Live keys (ids only): a tenant's own, or (admin) every key."""
    output.emit(call_master(url, lambda c: c.call(Calls.keys())).keys)


@key_app.command("revoke")
def key_revoke(key_id: str, url: MasterUrl = None) -> None:
    """Revoke a key by id (a tenant: only its own)."""
    print(json.dumps(call_master(url, lambda c: c.call(Calls.revoke_key(key_id))).model_dump(mode="json")))


@node_cred_app.command("enrol")
def node_enrol(
    node: str,
    out: Annotated[Path, typer.Option(help="write the token here (0600) for the Cubelet's --node-token-file")],
    url: MasterUrl = None,
) -> None:
    """A token for `node` (any earlier one stops working), written 0600, never printed."""
    r = call_master(url, lambda c: c.call(Calls.enrol(node)))
    write_secret(out, r.token)
    print(f"node {node}: token written to {out}")


@node_cred_app.command("revoke")
def node_revoke(node: str, url: MasterUrl = None) -> None:
    print(json.dumps(call_master(url, lambda c: c.call(Calls.revoke_node(node))).model_dump(mode="json")))


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
    from cubeaccel.host.service.audit import log_id, read
    from cubeaccel.host.service.audit import verify as check

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
            held = call_master(url, lambda c: c.call(Calls.seals())).seals
            seals = [s.model_dump() for s in held if lid.startswith(s.log)]
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
