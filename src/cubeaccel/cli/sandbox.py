"""`cubeaccel sandbox create|list|show|timeout|network|delete|exec|cp`: a user's sandboxes through CubeMaster, and
their workloads through the sandbox's node."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from cubeaccel.cli import output
from cubeaccel.cli.exec_argv import ExecCommand
from cubeaccel.cli.master_access import (
    AsJson,
    MasterUrl,
    call_master,
    fail,
)
from cubeaccel.cli.render import console
from cubeaccel.model.sandbox_states import SandboxState
from cubeaccel.protocol.errors import CubeError
from cubeaccel.transport.master_client import MasterClient
from cubeaccel.wire.master_api import Sandbox, SandboxError, SandboxReply, StartPhase, WarmSandbox

sandbox_app = typer.Typer(no_args_is_help=True, help="Sandboxes through CubeMaster.")


NODE_PHASES_GRACE_S = 2.0


def _node_phases(client: MasterClient, sid: str) -> list[StartPhase]:
    try:
        return client.sandbox_events(sid).phases
    except CubeError:
        return []  # the node's phases are a nicety; CubeMaster's state decides


def _wait_running(url: str | None, s: SandboxReply, quiet: bool, timeout_s: float) -> SandboxReply:
    """Poll CubeMaster until running or failed, printing each phase once as it appears: CubeMaster's own
    (its timeline) and the node's (VM up … guest validated, `GET /v1/sandboxes/{id}/events`: CubeMaster
    fetches them with the node token; the CLI has none)."""
    import time

    sid, t0 = s.id, time.time()
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
        s = call_master(url, lambda c: c.sandbox(sid))
        phases = [(e.at, e.phase) for e in s.timeline]
        node_phases: list[tuple[float, str]] = []
        if s.node:
            node_phases = [(p.at, p.phase) for p in call_master(url, lambda c: _node_phases(c, sid))]
        show(phases + node_phases)
        done = s.state in (SandboxState.RUNNING, SandboxState.FAILED, SandboxState.DELETED)
        if done and s.node and not node_phases:
            node_grace = node_grace or time.monotonic() + NODE_PHASES_GRACE_S
            done = time.monotonic() > node_grace
        if done or time.monotonic() > deadline:
            if s.state == SandboxState.FAILED and not quiet:
                err = s.error or SandboxError()
                console.print(f"[red]failed[/red] {err.code} (layer {err.layer}): {err.message}")
            return s
        time.sleep(0.2)


def _sandbox_table(rows: Sequence[Sandbox | WarmSandbox]) -> Table:
    t = Table(title="sandboxes")
    t.add_column("id", no_wrap=True)
    for col in ("state", "node", "template", "devices", "error"):
        t.add_column(col, overflow="fold")
    for s in rows:
        t.add_row(
            s.id,
            output.state(s.state) + _workload_note(s),
            s.node or "-",
            _template_cell(s),
            ", ".join(s.device_ids) or "-",
            _error_cell(s),
        )
    return t


def _template_cell(s: Sandbox | WarmSandbox) -> str:
    if s.template is None:
        return "-"
    return "@".join(x for x in (s.template.name, s.template.version) if x) or "-"


def _workload_note(s: Sandbox | WarmSandbox) -> str:
    """A running sandbox whose workload service stopped answering says so beside its state, with the code."""
    if not isinstance(s, Sandbox) or s.workload is None:
        return ""
    return f" (workload {s.workload.state}: {s.workload.reason or '-'})"


def _error_cell(s: Sandbox | WarmSandbox) -> str:
    return (s.error.code if s.error is not None else None) or ""


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
    tenant: Annotated[
        str | None, typer.Option(help="an admin's: whose sandbox (default: default); a tenant key names its own")
    ] = None,
    wait: Annotated[
        bool, typer.Option("--wait/--no-wait", help="return once running (or failed), phases shown")
    ] = True,
    wait_timeout: Annotated[float, typer.Option(help="seconds --wait waits")] = 600.0,
    url: MasterUrl = None,
    as_json: AsJson = False,
) -> None:
    """Create a sandbox and wait until it runs (phases shown live); on refusal or failure, print why."""
    as_json = as_json or output.machine()
    body: dict[str, Any] = {} if tenant is None else {"tenant": tenant}  # unset: the key's own (CubeMaster says)
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
    s: SandboxReply = call_master(url, lambda c: c.create(body))
    token = s.access_token
    if wait:  # even when already running: the phases it went through are shown
        s = _wait_running(url, s, quiet=as_json, timeout_s=wait_timeout).model_copy(update={"access_token": token})
    if as_json:
        print(json.dumps(s.model_dump(mode="json", by_alias=True), indent=2))
    else:
        console.print(_sandbox_table([s]))
        if s.access_token:  # for other tools; exec and cp obtain it with the key (connect)
            console.print(f"access token (envd; `sandbox exec`/`cp` get it with your key): {s.access_token}")
    if s.state == SandboxState.FAILED:
        raise typer.Exit(1)


@sandbox_app.command("list")
def sandbox_list(
    state: Annotated[str | None, typer.Option()] = None, url: MasterUrl = None, as_json: AsJson = False
) -> None:
    """Sandboxes; with no --state, an admin also sees the nodes' warm sandboxes (state `warm`, no tenant's)."""
    output.json_flag(as_json)
    rows = call_master(url, lambda c: c.sandboxes(state) + ([] if state else c.sandboxes("warm")))
    output.emit({"sandboxes": rows}, lambda: console.print(_sandbox_table(rows)))


@sandbox_app.command("show")
def sandbox_show(sandbox_id: str, url: MasterUrl = None) -> None:
    """One sandbox with its per-phase timeline."""
    output.emit(call_master(url, lambda c: c.sandbox(sandbox_id)))


@sandbox_app.command("timeout")
def sandbox_timeout(
    sandbox_id: str, seconds: Annotated[float, typer.Argument(help="from now")], url: MasterUrl = None
) -> None:
    """Extend (or shorten) a sandbox's lifetime; at expiry it is deleted through the release path."""
    s: SandboxReply = call_master(url, lambda c: c.set_timeout(sandbox_id, seconds))
    console.print(f"{sandbox_id} expires at {s.expires_at or 0:.0f} (in {seconds:.0f} s)")


@sandbox_app.command("network")
def sandbox_network(
    sandbox_id: str,
    allow_out: Annotated[
        list[str] | None, typer.Option("--allow-out", help="IPv4 address or CIDR kept whatever --deny-out says")
    ] = None,
    deny_out: Annotated[list[str] | None, typer.Option("--deny-out", help="IPv4 address or CIDR taken away")] = None,
    url: MasterUrl = None,
) -> None:
    """Replace a running sandbox's egress narrowing, in place: the template's allowlist less --deny-out, plus
    --allow-out (neither: the template's whole allowlist). It replaces the create's narrowing whole."""
    body = {"allow_out": list(allow_out or []), "deny_out": list(deny_out or [])}
    s: SandboxReply = call_master(url, lambda c: c.set_network(sandbox_id, body))
    policy = s.request.network_policy if s.request is not None else None
    output.emit(
        {"sandbox_id": sandbox_id, "network_policy": policy},
        lambda: console.print(f"{sandbox_id} egress: {', '.join((policy or {}).get('egress') or []) or 'none'}"),
    )


@sandbox_app.command("delete")
def sandbox_delete(sandbox_id: str, url: MasterUrl = None) -> None:
    s: SandboxReply = call_master(url, lambda c: c.delete(sandbox_id))
    output.emit(s, lambda: console.print(_sandbox_table([s])))


# ---- workloads: exec and cp, through the sandbox's node (Cubelet's proxy) ------------------------------------------
TokenOpt = Annotated[
    str | None,
    typer.Option(
        "--token",
        help="the sandbox's access token (default $CUBEACCEL_SANDBOX_TOKEN; without either, the key obtains it)",
    ),
]


def _workload(sandbox_id: str, url: str | None, token: str | None, timeout: float | None = None) -> Any:
    """A workload client for the sandbox, at its node's Cubelet proxy. CubeMaster names it to the sandbox's own
    tenant, so a tenant key is enough: with a token given (`--token`, $CUBEACCEL_SANDBOX_TOKEN) only the endpoint
    is asked for (`GET …/workload`); without one, connect (`POST …/connect`) gives the endpoint and the token, as
    E2B's connect gives it to the owner."""
    from cubeaccel.transport.workload_client import WorkloadClient

    token = token or os.environ.get("CUBEACCEL_SANDBOX_TOKEN")
    if token:
        endpoint = call_master(url, lambda c: c.workload_endpoint(sandbox_id))
        return WorkloadClient.over(endpoint.url, token, timeout=timeout)
    connection = call_master(url, lambda c: c.connect(sandbox_id))
    return WorkloadClient.over(connection.url, connection.access_token, timeout=timeout)


def _env_pairs(values: list[str]) -> dict[str, str]:
    out = {}
    for v in values:
        k, sep, val = v.partition("=")
        if not sep or not k:
            raise typer.BadParameter(f"--env wants K=V, got {v!r}")
        out[k] = val
    return out


TIMED_OUT_EXIT = 124


@sandbox_app.command("exec", cls=ExecCommand, context_settings={"allow_interspersed_args": False})
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

    if cmd and cmd[0] == "--":  # ExecCommand puts it after the id; click keeps it
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
    except CubeError as e:  # past --timeout: said, and 124 as timeout(1) exits
        fail(e, TIMED_OUT_EXIT if e.details.get("connect_code") == "deadline_exceeded" else 1)
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


def register_top_level(root: typer.Typer) -> None:
    root.add_typer(sandbox_app, name="sandbox")
