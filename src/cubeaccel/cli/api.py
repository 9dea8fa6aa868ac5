"""`cubeaccel api serve`: the E2B-compatible front door (docs/e2b.md)."""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Annotated

import typer

from cubeaccel.cli.locate import UP_STATE
from cubeaccel.cli.master_access import master_url, write_secret

app = typer.Typer(no_args_is_help=True, help="The E2B-compatible API: `from e2b import Sandbox` against cubeaccel.")


@app.command("serve")
def serve_cmd(
    master: Annotated[
        str | None,
        typer.Option(
            "--master",
            help="CubeMaster URL, or several comma-separated (replicas: failover between them); default: "
            "$CUBEACCEL_MASTER, then the one `cubeaccel up` started",
        ),
    ] = None,
    listen: Annotated[str, typer.Option(help="HOST:PORT")] = "127.0.0.1:3000",
    admin_key_file: Annotated[
        Path, typer.Option(help="a CubeMaster admin key: finds each sandbox's node for envd traffic")
    ] = UP_STATE / "admin.key",
    secret_file: Annotated[
        Path,
        typer.Option(help="derives sandboxes' envd tokens; share it between replicas (made, 0600, when missing)"),
    ] = UP_STATE / "frontdoor.secret",
    domain: Annotated[
        str | None, typer.Option(help="the E2B_DOMAIN: REST at api.DOMAIN, envd at 49983-<id>.DOMAIN (https)")
    ] = None,
    cert: Annotated[Path | None, typer.Option(help="TLS certificate chain (PEM): serve https, HTTP/2 and 1.1")] = None,
    key: Annotated[Path | None, typer.Option(help="the certificate's private key (PEM)")] = None,
    create_wait: Annotated[float, typer.Option(min=1.0, help="seconds create waits for the guest")] = 300.0,
    create_lease: Annotated[
        float,
        typer.Option(
            min=1.0,
            help="seconds a sandbox lives until its create's reply is ready (renewed meanwhile): what a front door "
            "that dies mid-create leaves behind is deleted within it",
        ),
    ] = 60.0,
) -> None:
    """Serve E2B's REST API (create, connect, get_info, list, kill, set_timeout) over CubeMaster, and route envd
    traffic (by E2b-Sandbox-Id or Host) to each sandbox's node. Callers use CubeMaster tenant keys as E2B keys."""
    from cubeaccel.frontdoor.app import FrontDoorConfig
    from cubeaccel.frontdoor.serve import read_secret, serve

    if (cert is None) != (key is None):
        raise typer.BadParameter("--cert and --key go together")
    if not secret_file.exists():
        write_secret(secret_file, secrets.token_urlsafe(32))
    try:
        admin = read_secret(admin_key_file)
        secret = read_secret(secret_file).encode()
    except (OSError, ValueError) as e:
        raise typer.BadParameter(str(e)) from e
    cfg = FrontDoorConfig(master_url(master), admin, secret, domain, create_wait, create_lease)
    serve(cfg, listen, cert, key)
