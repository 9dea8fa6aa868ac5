"""`cubeaccel cubelet ...` and the node-level verbs (`devices`, `device`, `events`, `demo`)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Any

import typer

from cubeaccel.cli.master import MasterUrl, _call
from cubeaccel.cli.render import console, device_table, event_table
from cubeaccel.model.errors import CubeError
from cubeaccel.wire.cubelet_client import CubeletClient
from cubeaccel.wire.node_sig import TokenFile

app = typer.Typer(no_args_is_help=True, help="Cubelet: the node-local owner of every accelerator.")

DEFAULT_STATE = Path(os.environ.get("CUBEACCEL_STATE_DIR", Path.home() / ".local/state/cubeaccel/cubelet"))
StateDir = Annotated[Path, typer.Option("--state-dir", help="Cubelet state directory (store, socket)")]
Url = Annotated[str | None, typer.Option("--url", help="Cubelet TCP URL instead of the unix socket")]


def _listen(value: str | None) -> tuple[str, int] | None:
    if value is None:
        return None
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise typer.BadParameter(f"expected HOST:PORT, got {value!r}")
    return host, int(port)


def _fail(e: CubeError) -> None:
    console.print(f"[red]error[/red] {e.code} (layer {e.layer}): {e.message}")
    if e.details:
        console.print(json.dumps(e.details, indent=2, default=str))
    raise typer.Exit(1)


@app.command("serve")
def serve_cmd(
    state_dir: StateDir = DEFAULT_STATE,
    backend: Annotated[str, typer.Option(help="simulated | vfio | emulated")] = "simulated",
    profile: Annotated[str, typer.Option(help="simulated devices, e.g. h100x8 or 2xh100,2xt4")] = "h100x8",
    listen: Annotated[str | None, typer.Option(help="also serve TCP on HOST:PORT")] = None,
    sysfs_root: Annotated[Path, typer.Option(help="sysfs root for --backend vfio")] = Path("/sys"),
    dev_root: Annotated[Path, typer.Option(help="/dev for --backend vfio's host readiness checks")] = Path("/dev"),
    proc_root: Annotated[Path, typer.Option(help="/proc for --backend vfio's host readiness checks")] = Path("/proc"),
    allow: Annotated[list[str] | None, typer.Option(help="vendor:device patterns (vfio)")] = None,
    tick: Annotated[float, typer.Option(help="seconds between periodic reconciles")] = 2.0,
    reservation_ttl: Annotated[float, typer.Option(help="seconds before an unstarted reservation expires")] = 300.0,
    release_timeout: Annotated[float, typer.Option(help="seconds release may wait before quarantine")] = 30.0,
    default_lifetime: Annotated[
        float, typer.Option(help="seconds a started sandbox lives when its creator named no lifetime")
    ] = 24 * 3600.0,
    node: Annotated[str, typer.Option(help="node name")] = "node-1",
    master: Annotated[str | None, typer.Option(help="CubeMaster URL to register with (needs --listen)")] = None,
    node_token_file: Annotated[
        Path | None,
        typer.Option(help="this node's token from enrolment (0600): sent to CubeMaster, asked of callers on --listen"),
    ] = None,
    vm_start: Annotated[str, typer.Option(help="real MicroVMs: template (snapshot restore) or cold")] = "template",
    detach_timeout: Annotated[float, typer.Option(help="real MicroVMs: seconds to wait for DEVICE_DELETED")] = 10.0,
    pinnable_memory_mib: Annotated[
        int | None,
        typer.Option(min=0, help="advertise this much lockable guest memory instead of MemAvailable (simulated nodes)"),
    ] = None,
    holder_scan_exempt_pid: Annotated[
        list[int] | None,
        typer.Option(
            help="vfio: a process whose fds cannot be read but that holds no device (repeatable; audited at start)"
        ),
    ] = None,
    guest_images: Annotated[
        Path | None,
        typer.Option(help="simulated nodes: JSON list of guest images (docs/api.md shape) replacing the default set"),
    ] = None,
    log_level: Annotated[str | None, typer.Option(help="JSON logs on stderr: debug|info|warning|error")] = None,
) -> None:
    """Run Cubelet: initialize the host, reconcile, then serve the API."""
    from cubeaccel.wire.telemetry import configure_logging

    configure_logging(log_level)  # None: $CUBEACCEL_LOG_LEVEL, else info
    from cubeaccel.cubelet.inventory import initialize_host
    from cubeaccel.cubelet.lifecycle import CubeletConfig
    from cubeaccel.cubelet.reconcile import reconcile
    from cubeaccel.cubelet.runtime import RuntimeOptions, build_cubelet
    from cubeaccel.cubelet.server import Ticker, serve

    addr = _listen(listen)
    from cubeaccel.host.private import private_umask

    private_umask()  # the store, the socket, shims' dirs and VMM files: owner-only whatever the parent
    if master is not None and addr is None:
        raise typer.BadParameter("--master needs --listen HOST:PORT so CubeMaster can reach this Cubelet")
    if addr is not None and node_token_file is None:
        raise typer.BadParameter("--listen needs --node-token-file: the TCP API accepts only CubeMaster's credential")
    token = TokenFile(node_token_file).current if node_token_file is not None else None  # re-read on change
    if (
        tick <= 0
        or reservation_ttl <= 0
        or release_timeout <= 0
        or default_lifetime <= 0
        or not 0 < detach_timeout <= 3600
    ):
        raise typer.BadParameter("tick, reservation-ttl, release-timeout and detach-timeout must be > 0")
    try:
        cubelet = build_cubelet(
            RuntimeOptions(
                state_dir=state_dir,
                backend=backend,
                profile=profile,
                sysfs_root=sysfs_root,
                dev_root=dev_root,
                proc_root=proc_root,
                allow=tuple(allow or ("10de:*",)),
                vm_start=vm_start,
                detach_timeout_s=detach_timeout,
                holder_scan_exempt_pids=frozenset(holder_scan_exempt_pid or ()),
                guest_images=guest_images,
                config=CubeletConfig(
                    node_name=node,
                    reservation_ttl_s=reservation_ttl,
                    default_lifetime_s=default_lifetime,
                    release_timeout_s=release_timeout,
                    pinnable_memory_mib=pinnable_memory_mib,
                ),
            )
        )
        from cubeaccel.cubelet.metrics import metrics_of

        metrics_of(cubelet)  # counting from the first event: the host's initialization
        if holder_scan_exempt_pid:
            with cubelet.store.tx() as t:
                t.event("holder_scan_exempt", "operator", details={"pids": sorted(holder_scan_exempt_pid)})
        initialize_host(cubelet)
        repairs = reconcile(cubelet)  # before any capacity is advertised
    except CubeError as e:
        _fail(e)
        return
    ticker = Ticker(cubelet, tick)
    ticker.start()
    heartbeat = None
    if master is not None and addr is not None:
        from cubeaccel.cubelet.heartbeat import Heartbeat
        from cubeaccel.cubelet.status_push import StatusPush

        pusher = StatusPush(master, node, token=token)
        pusher.start()
        cubelet.status_sink = pusher.push
        heartbeat = Heartbeat(cubelet, master, f"http://{addr[0]}:{addr[1]}", tick, token=token)
        heartbeat.start()
    sock = state_dir / "cubelet.sock"
    from cubeaccel.cubelet.heartbeat import host_state

    host, _ = host_state(cubelet)  # serving, but says so when nothing can be handed out on this host
    print(
        json.dumps(
            {
                "cubelet": "ready",
                "socket": str(sock),
                "backend": backend,
                "repairs": len(repairs),
                "pid": os.getpid(),
                "host_ready": host["ready"],
                "host_problems": [p["code"] for p in host["problems"]],
            }
        ),
        flush=True,
    )
    try:
        serve(cubelet, sock, addr, token)
    finally:
        ticker.stop()
        if heartbeat is not None:
            heartbeat.stop()


def _client(state_dir: Path, url: str | None) -> CubeletClient:
    return CubeletClient(socket=None if url else state_dir / "cubelet.sock", url=url)


NodeOpt = Annotated[
    str | None, typer.Option("--node", help="through CubeMaster (admin key) instead of this host's Cubelet socket")
]


def devices_cmd(
    state_dir: StateDir = DEFAULT_STATE,
    url: Url = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
    node: NodeOpt = None,
    master: MasterUrl = None,
) -> None:
    """Device table: address, model, NUMA, state, sandbox, reason."""
    if node is not None:
        devs = _call(master, lambda c: c.request("GET", f"/v1/nodes/{node}/devices"))["devices"]
    else:
        try:
            devs = _client(state_dir, url).devices()
        except CubeError as e:
            _fail(e)
            return
    if as_json:
        print(json.dumps({"devices": devs}, indent=2))
    else:
        console.print(device_table(devs))


def device_cmd(
    verb: Annotated[str, typer.Argument(help="quarantine | recover | disable | enable")],
    device_id: Annotated[str, typer.Argument()],
    reason: Annotated[str, typer.Option(help="why (audited)")],
    who: Annotated[str | None, typer.Option(help="operator identity (audited); on the local socket only")] = None,
    state_dir: StateDir = DEFAULT_STATE,
    url: Url = None,
    restore_driver: Annotated[
        bool, typer.Option(help="disable only: give the device back to the host driver it had before vfio-pci")
    ] = False,
    node: NodeOpt = None,
    master: MasterUrl = None,
) -> None:
    """Operator verbs on one device; audited with who and why. With --node, through CubeMaster with an admin
    key, which is then the audited identity (--who is not taken)."""
    extra: dict[str, Any] = {"restore_driver": True} if restore_driver else {}
    if node is not None:
        if who is not None:
            raise typer.BadParameter("--who is the admin key's identity through CubeMaster; leave it out")
        path = f"/v1/nodes/{node}/devices/{device_id}/{verb}"
        d = _call(master, lambda c: c.request("POST", path, {"reason": reason, **extra}))["device"]
    else:
        if who is None:
            raise typer.BadParameter("--who is required on the local socket (operator identity, audited)")
        try:
            d = _client(state_dir, url).verb(device_id, verb, who, reason, **extra)
        except CubeError as e:
            _fail(e)
            return
    console.print(device_table([d], title=f"{verb}: {device_id}"))


def events_cmd(
    state_dir: StateDir = DEFAULT_STATE,
    url: Url = None,
    since: Annotated[int, typer.Option(min=0)] = 0,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """The event trail since a cursor."""
    try:
        evs = _client(state_dir, url).events(since)
    except CubeError as e:
        _fail(e)
        return
    if as_json:
        print(json.dumps(evs, indent=2))
    else:
        console.print(event_table(evs["events"]))


def demo_cmd(profile: Annotated[str, typer.Option(help="simulated devices, when QEMU is missing")] = "h100x2") -> None:
    """A GPU-style sandbox end to end on the embedded single node (`up`, create, delete, `down`)."""
    from cubeaccel.cli.demo import run_demo

    raise typer.Exit(run_demo(profile))


def register_top_level(root: typer.Typer) -> None:
    """Node verbs operators type most (`cubeaccel devices`) live at the top level."""
    root.command("devices")(devices_cmd)
    root.command("device")(device_cmd)
    root.command("events")(events_cmd)
    root.command("demo")(demo_cmd)
