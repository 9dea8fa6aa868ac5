"""How the CLI reaches CubeMaster: its URL, the API key, and one call with the error a person can act on."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, NoReturn, TypeVar

import typer

from cubeaccel.cli import output
from cubeaccel.cli.locate import UP_STATE, up_info
from cubeaccel.protocol.errors import CubeError
from cubeaccel.transport.master_client import MasterClient

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


T = TypeVar("T")
MASTER_FIX = "is it running? start one with `cubeaccel up`, or pass --master URL / set $CUBEACCEL_MASTER"


def call_master(url: str | None, fn: Callable[[MasterClient], T]) -> T:
    client = MasterClient(master_url(url), key=api_key())
    try:
        with output.reaching("CubeMaster", client.url, MASTER_FIX):
            return fn(client)
    finally:
        client.close()
