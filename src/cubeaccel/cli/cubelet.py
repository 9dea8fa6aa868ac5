"""`cubeaccel cubelet ...` and the node-level verbs (`devices`, `device`, `events`, `demo`)."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from pydantic import BaseModel

from cubeaccel.cli import output
from cubeaccel.cli.locate import CUBELET_STATE, cubelet_socket
from cubeaccel.cli.master_access import MasterUrl, call_master
from cubeaccel.cli.render import console, device_table, event_table
from cubeaccel.model.bars import is_bar_size
from cubeaccel.model.event_kinds import EventKind
from cubeaccel.protocol.errors import CubeError
from cubeaccel.transport.cubelet_client import CubeletClient
from cubeaccel.transport.master_client import Calls
from cubeaccel.transport.node_sig import TokenFile
from cubeaccel.wire.cubelet_api import DeviceReply, Event, Reservation

if TYPE_CHECKING:  # the serve path imports these lazily: a CLI call that does not serve does not load them
    from cubeaccel.cubelet.lifecycle import Cubelet
    from cubeaccel.cubelet.reconcile import Repair
    from cubeaccel.cubelet.snapshots import Shape, TemplateSnapshots

app = typer.Typer(no_args_is_help=True, help="Cubelet: the node-local owner of every accelerator.")
reservation_app = typer.Typer(no_args_is_help=True, help="Reservations a Cubelet holds (node view).")

DEFAULT_STATE = CUBELET_STATE
StateDir = Annotated[Path, typer.Option("--state-dir", help="Cubelet state directory (store, socket)")]
ClientStateDir = Annotated[
    Path | None,
    typer.Option(
        "--state-dir",
        help="Cubelet state directory (default: $CUBEACCEL_STATE_DIR's Cubelet, else the one `cubeaccel up` started)",
        show_default=False,
    ),
]
Url = Annotated[str | None, typer.Option("--url", help="Cubelet TCP URL instead of the unix socket")]
AsJson = Annotated[bool, typer.Option("--json", help="same as -o json")]


def _listen(value: str | None) -> tuple[str, int] | None:
    if value is None:
        return None
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise typer.BadParameter(f"expected HOST:PORT, got {value!r}")
    return host, int(port)


def _fail(e: CubeError, exit_code: int = 1) -> None:
    output.fail(e, exit_code)


def _shapes(raw: list[str]) -> list[Shape]:
    from cubeaccel.cubelet.snapshots import Shape

    out = []
    for item in raw:
        mem, _, cpus = item.partition(":")
        if not mem.isdigit() or not (cpus or "1").isdigit() or not 64 <= int(mem) <= 4 << 20:
            raise typer.BadParameter(f"--prepare-shape {item!r}: want MIB[:VCPUS], e.g. 65536:8")
        if not 1 <= int(cpus or "1") <= 256:
            raise typer.BadParameter(f"--prepare-shape {item!r}: VCPUS is 1..256")
        out.append(Shape(int(mem), int(cpus or "1")))
    return out


def _prepared_templates(raw: list[str]) -> list[Any]:
    """`--prepare-template FILE[=VCPUS]`: each template as a request of its sandboxes (one device of its class)."""
    out = []
    for item in raw:
        path, eq, cpus = item.rpartition("=")
        if not eq or not cpus.isdigit():
            path, cpus = item, "1"
        if not 1 <= int(cpus) <= 256:
            raise typer.BadParameter(f"--prepare-template {item!r}: want TEMPLATE_FILE[=VCPUS], VCPUS 1..256")
        out.append(replace(_warm_request(Path(path)), vcpus=int(cpus)))
    return out


def _warm_pools(raw: list[str]) -> list[tuple[Path, int]]:
    out = []
    for item in raw:
        path, _, size = item.rpartition("=")
        if not path or not size.isdigit() or not 0 <= int(size) <= 64:
            raise typer.BadParameter(f"--warm {item!r}: want TEMPLATE_FILE=SIZE, SIZE 0..64")
        out.append((Path(path), int(size)))
    return out


def _warm_request(path: Path) -> Any:
    """A pool's shape from a template file: its frozen contract, one device of its class, its memory as CubeMaster
    asks for it (the template's size and pinning: a create through CubeMaster must match the pool field by field)."""
    from cubeaccel.cubelet.lifecycle import ReservationRequest
    from cubeaccel.model.contract import freeze
    from cubeaccel.wire.templates import load_template

    t = load_template(path)
    return ReservationRequest(
        accel_class=t.accel_class,
        template=t.name,
        contract=freeze(t),
        memory_mib=t.memory_mib,
        pin_memory=t.pin_memory,
    )


def _check_durations(
    tick: float, reservation_ttl: float, release_timeout: float, lifetime: float, detach: float, scrub: float
) -> None:
    if min(tick, reservation_ttl, release_timeout, lifetime, scrub) <= 0 or not 0 < detach <= 3600:
        raise typer.BadParameter("tick, reservation-ttl, release-timeout, detach-timeout and scrub-timeout must be > 0")


def _snapshots(cubelet: Cubelet, vm_start: str, templates: list[Any], shapes: list[Shape]) -> TemplateSnapshots | None:
    """The node's template snapshots, planned from its devices (real MicroVMs starting from templates only)."""
    from cubeaccel.cubelet.process_shim import ProcessShimDriver
    from cubeaccel.cubelet.snapshots import TemplateSnapshots

    if not isinstance(cubelet.shim, ProcessShimDriver) or vm_start != "template":
        return None
    return TemplateSnapshots(cubelet, cubelet.shim.prepare_snapshots, templates, shapes)


def _bring_up(
    cubelet: Cubelet,
    snapshots: TemplateSnapshots | None,
    exempt_pids: list[int],
    warm_reset: bool,
    warm: list[str],
) -> list[Repair]:
    """Before anything is served: the shim fork server started, the host initialized, the store reconciled
    with the host (before any capacity is advertised), the warm pools set, then the template snapshots of what
    the node serves, shaped by the devices it found, queued (made in the background, never on a tenant's
    start). The repairs."""
    from cubeaccel.cubelet.inventory import initialize_host
    from cubeaccel.cubelet.process_shim import ProcessShimDriver
    from cubeaccel.cubelet.reconcile import reconcile

    if isinstance(cubelet.shim, ProcessShimDriver):  # its fork server comes up while the host initializes
        cubelet.shim.warm()
    if exempt_pids:
        with cubelet.change() as t:
            t.event(EventKind.HOLDER_SCAN_EXEMPT, "operator", details={"pids": sorted(exempt_pids)})
    initialize_host(cubelet)
    if warm_reset:
        cubelet.warm.reset()  # before reconcile, which then releases the forgotten pools' warm sandboxes
    repairs = reconcile(cubelet)
    for tpl_path, size in _warm_pools(warm):
        cubelet.warm.set_pool(_warm_request(tpl_path), size)
    if snapshots is not None:  # before the first warm start, which restores one
        snapshots.refresh()
    cubelet.warm.start()
    return repairs


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
    shim_launch: Annotated[
        str, typer.Option(help="real MicroVMs: fork (from a pre-started shim fork server) or spawn each shim")
    ] = "fork",
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
    network_pool: Annotated[str, typer.Option(help="sandbox networks: IPv4 pool for each sandbox's veth /30")] = (
        "100.96.0.0/16"
    ),
    network_uplink_netns: Annotated[
        str | None, typer.Option(help="sandbox networks: named netns for the uplink ends (default: the host's)")
    ] = None,
    allow_readonly_mount: Annotated[
        list[str] | None,
        typer.Option(help="a host directory templates may show read-only in guests (repeatable; default none)"),
    ] = None,
    scrub: Annotated[
        list[str] | None,
        typer.Option(help="CLASS=none|trusted-vm: scrub policy per device class (default trusted-vm; docs/scrub.md)"),
    ] = None,
    scrub_timeout: Annotated[
        float, typer.Option(help="seconds the scrub VM may take (boot, zero, verify, teardown) before quarantine")
    ] = 600.0,
    scrub_image: Annotated[
        str | None, typer.Option(help="guest image digest the scrub VM boots (default: the newest built image)")
    ] = None,
    emulated_devices: Annotated[
        int, typer.Option(min=0, max=32, help="--backend emulated: how many edu stand-in devices the node has")
    ] = 2,
    warm: Annotated[
        list[str] | None,
        typer.Option(
            help="real MicroVMs: TEMPLATE_FILE=SIZE, keep SIZE warm sandboxes of that template (one device each; "
            "repeatable; changeable at run time with PUT /v1/warm/pools; the journal keeps pools and drain across "
            "restarts, docs/warm.md)"
        ),
    ] = None,
    warm_reset: Annotated[
        bool,
        typer.Option(
            help="forget the warm pools and drain the journal kept: only this start's --warm pools "
            "(`cubeaccel up`'s Cubelet; the warm sandboxes of the others are released)"
        ),
    ] = False,
    warm_max_starts: Annotated[
        int | None,
        typer.Option(min=1, max=64, help="warm sandboxes started at once by the refill (default: one per 2 CPUs)"),
    ] = None,
    memory_device: Annotated[
        list[int] | None,
        typer.Option(
            help="--backend emulated: an ivshmem-plain stand-in whose memory (BYTES, a power of two, 4096..64 MiB) is "
            "a file kept across sandboxes (repeatable; docs/scrub.md)"
        ),
    ] = None,
    prepare_shape: Annotated[
        list[str] | None,
        typer.Option(
            help="real MicroVMs: MIB[:VCPUS], sandboxes without a template: their snapshots (the default image, "
            "one per machine the node's devices give) are made at start and when devices change (repeatable)"
        ),
    ] = None,
    prepare_template: Annotated[
        list[str] | None,
        typer.Option(
            help="real MicroVMs: TEMPLATE_FILE[=VCPUS], the template's snapshot, its machine shaped for the BARs of "
            "the node's devices it admits, made at start and when devices change (repeatable; warm pools' "
            "templates are prepared too)"
        ),
    ] = None,
    testdev_membar: Annotated[
        list[int] | None,
        typer.Option(
            help="--backend emulated: a GPU-shaped pci-testdev stand-in whose 64-bit prefetchable BAR2 is BYTES (a "
            "power of two; repeatable; docs/shim.md)"
        ),
    ] = None,
) -> None:
    """Run Cubelet: initialize the host, reconcile, then serve the API."""
    from cubeaccel.transport.telemetry import configure_logging

    configure_logging(log_level)  # None: $CUBEACCEL_LOG_LEVEL, else info
    from cubeaccel.cubelet.lifecycle import CubeletConfig
    from cubeaccel.cubelet.runtime import MasterLink, RuntimeOptions, build_served
    from cubeaccel.cubelet.server import Ticker, serve

    addr = _listen(listen)
    from cubeaccel.host.service import statelock
    from cubeaccel.host.service.private import private_umask

    private_umask()  # the store, the socket, shims' dirs and VMM files: owner-only whatever the parent
    try:
        lock = statelock.acquire(state_dir, "cubelet")  # held until exit: one Cubelet per store
    except CubeError as e:
        _fail(e, statelock.LOCKED_EXIT)
        return
    if master is not None and addr is None:
        raise typer.BadParameter("--master needs --listen HOST:PORT so CubeMaster can reach this Cubelet")
    if addr is not None and node_token_file is None:
        raise typer.BadParameter("--listen needs --node-token-file: the TCP API accepts only CubeMaster's credential")
    token = TokenFile(node_token_file).current if node_token_file is not None else None  # re-read on change
    shapes = _shapes(prepare_shape or [])
    if not all(is_bar_size(m) for m in testdev_membar or ()):
        raise typer.BadParameter(f"--testdev-membar {testdev_membar}: each a power of two up to 2^48 bytes")
    _check_durations(tick, reservation_ttl, release_timeout, default_lifetime, detach_timeout, scrub_timeout)
    from cubeaccel.cubelet.scrub import parse_policy
    from cubeaccel.host.service.audit import AuditLog

    audit = AuditLog(state_dir / "audit.jsonl")  # requests, host changes for sandboxes and each device's custody
    link = None if master is None or addr is None else MasterLink(master, f"http://{addr[0]}:{addr[1]}", tick, token)
    try:
        scrub_policy = parse_policy(scrub or [])
        served = build_served(
            RuntimeOptions(
                state_dir=state_dir,
                backend=backend,
                profile=profile,
                sysfs_root=sysfs_root,
                dev_root=dev_root,
                proc_root=proc_root,
                allow=tuple(allow or ("10de:*",)),
                vm_start=vm_start,
                shim_launch=shim_launch,
                detach_timeout_s=detach_timeout,
                holder_scan_exempt_pids=frozenset(holder_scan_exempt_pid or ()),
                guest_images=guest_images,
                config=CubeletConfig(
                    node_name=node,
                    reservation_ttl_s=reservation_ttl,
                    default_lifetime_s=default_lifetime,
                    release_timeout_s=release_timeout,
                    pinnable_memory_mib=pinnable_memory_mib,
                    network_pool=network_pool,
                    network_uplink_netns=network_uplink_netns,
                    readonly_mount_allowlist=tuple(allow_readonly_mount or ()),
                    scrub_policy=scrub_policy,
                    scrub_timeout_s=scrub_timeout,
                    warm_max_concurrent_starts=warm_max_starts or max(1, (os.cpu_count() or 2) // 2),
                ),
                scrub_image=scrub_image,
                emulated_devices=emulated_devices,
                memory_devices=tuple(memory_device or ()),
                testdev_membars=tuple(testdev_membar or ()),
            ),
            audit=audit,
            master=link,
        )
        cubelet = served.cubelet
        templates = _prepared_templates(prepare_template or [])  # a file that does not load: refused by code
        snapshots = _snapshots(cubelet, vm_start, templates, shapes)
        repairs = _bring_up(cubelet, snapshots, holder_scan_exempt_pid or [], warm_reset, warm or [])
    except CubeError as e:
        _fail(e)
        return
    ticker = Ticker(cubelet, tick, after_pass=snapshots.refresh if snapshots is not None else None)
    ticker.start()
    if served.status_push is not None:
        served.status_push.start()  # status pushes from now on; the heartbeat starts once serving
    heartbeat = served.heartbeat
    sock = state_dir / "cubelet.sock"
    from cubeaccel.cubelet.heartbeat import held, host_state

    host, _ = host_state(cubelet)  # serving, but says so when nothing can be handed out on this host
    print(
        json.dumps(
            {
                "cubelet": "ready",
                "socket": str(sock),
                "backend": backend,
                "repairs": len(repairs),
                "pid": os.getpid(),
                "host_ready": host.ready,
                "host_problems": [p.code for p in (*host.problems, *held(cubelet))],
            }
        ),
        flush=True,
    )
    try:
        # The node tells CubeMaster it is ready only once its API answers: a heartbeat before the listeners are
        # bound let a create (or `up`) reach a Cubelet that refused the connection.
        serve(
            cubelet,
            served.metrics,
            served.audit,
            sock,
            addr,
            token,
            on_serving=heartbeat.start if heartbeat is not None else None,
        )
    finally:
        ticker.stop()
        if heartbeat is not None:
            heartbeat.stop()
        lock.release()


class _Node:
    """The Cubelet a node verb talks to, and the one-line error when it is not there."""

    def __init__(self, state_dir: Path | None, url: str | None) -> None:
        self.where = url or str(cubelet_socket(state_dir))
        self.client = CubeletClient(socket=None if url else Path(self.where), url=url)
        self.fix = "is it running? start one with `cubeaccel up` or `cubeaccel cubelet serve --state-dir DIR`" + (
            "" if url else ", or pass --state-dir / --url"
        )

    def __call__(self, fn: Any) -> Any:
        try:
            with output.reaching("Cubelet", self.where, self.fix):
                return fn(self.client)
        finally:
            self.client.close()


NodeOpt = Annotated[
    str | None, typer.Option("--node", help="through CubeMaster (admin key) instead of this host's Cubelet socket")
]


def devices_cmd(
    state_dir: ClientStateDir = None,
    url: Url = None,
    as_json: AsJson = False,
    node: NodeOpt = None,
    master: MasterUrl = None,
) -> None:
    """Device table: full id, address, model, NUMA, state (colored), sandbox, reason."""
    output.json_flag(as_json)
    if node is not None:
        devs = [_shown(d) for d in call_master(master, lambda c: c.call(Calls.node_devices(node))).devices]
    else:
        devs = [_shown(d) for d in _Node(state_dir, url)(lambda c: c.devices())]
    output.emit({"devices": devs}, lambda: console.print(device_table(devs)))


def device_cmd(
    verb: Annotated[str, typer.Argument(help="quarantine | recover | disable | enable")],
    device_id: Annotated[str, typer.Argument(help="the full device id, as `cubeaccel devices` shows it")],
    reason: Annotated[str, typer.Option(help="why (audited)")],
    who: Annotated[str | None, typer.Option(help="operator identity (audited); on the local socket only")] = None,
    state_dir: ClientStateDir = None,
    url: Url = None,
    restore_driver: Annotated[
        bool, typer.Option(help="disable only: give the device back to the host driver it had before vfio-pci")
    ] = False,
    node: NodeOpt = None,
    master: MasterUrl = None,
) -> None:
    """Operator verbs on one device (by its full id or its PCI address); audited with who and why. With --node,
    through CubeMaster with an admin key, which is then the audited identity (--who is not taken)."""
    if node is not None:
        if who is not None:
            raise typer.BadParameter("--who is the admin key's identity through CubeMaster; leave it out")
        path = f"/v1/nodes/{node}/devices/{device_id}/{verb}"
        extra = {"restore_driver": True} if restore_driver else {}
        d = call_master(master, lambda c: c.request("POST", path, {"reason": reason, **extra}))["device"]
        output.emit(d, lambda: console.print(device_table([d], title=f"{verb}: {device_id} ({reason})")))
        return
    if who is None:
        raise typer.BadParameter("--who is required on the local socket (operator identity, audited)")
    local_who: str = who

    def act(c: CubeletClient) -> DeviceReply:
        devs = c.devices()
        if not any(d.id == device_id for d in devs):
            by_address = [d.id for d in devs if d.address == device_id]
            if len(by_address) == 1:  # `0000:10:00.0` as `devices` shows it in the address column
                return c.verb(by_address[0], verb, local_who, reason, restore_driver=restore_driver)
        return c.verb(device_id, verb, local_who, reason, restore_driver=restore_driver)

    d = _shown(_Node(state_dir, url)(act))
    output.emit(d, lambda: console.print(device_table([d], title=f"{verb}: {device_id} (by {who}: {reason})")))


def _shown(record: BaseModel) -> dict[str, Any]:
    """A reply record as `--json` prints it and the tables read it: its wire JSON."""
    return record.model_dump(mode="json", by_alias=True)


def _matches(e: Event, device: str | None, sandbox: str | None, kind: str | None, event: str | None) -> bool:
    return (
        (device is None or e.device_id == device)
        and (sandbox is None or e.sandbox_id == sandbox)
        and (kind is None or e.kind == kind)
        and (event is None or e.event == event)
    )


def events_cmd(
    state_dir: ClientStateDir = None,
    url: Url = None,
    since: Annotated[int, typer.Option(min=0, help="only events after this sequence number")] = 0,
    limit: Annotated[int, typer.Option(min=1, max=10000, help="at most this many (the newest)")] = 50,
    device: Annotated[str | None, typer.Option(help="only this device (full id)")] = None,
    sandbox: Annotated[str | None, typer.Option(help="only this sandbox")] = None,
    kind: Annotated[str | None, typer.Option(help="only this kind, e.g. transition")] = None,
    event: Annotated[str | None, typer.Option(help="only this event, e.g. quarantine")] = None,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="then print new events as they happen")] = False,
    as_json: AsJson = False,
) -> None:
    """The event trail, newest first (with --follow, then each new event as it happens, one line or JSON each)."""
    import time

    output.json_flag(as_json)
    node = _Node(state_dir, url)

    def page(c: CubeletClient, after: int) -> tuple[list[Event], int]:
        evs: list[Event] = []
        cursor = after
        while True:
            body = c.events(cursor, 10000, device_id=device or None, sandbox_id=sandbox or None)
            evs += body.events
            if len(body.events) < 10000:
                return evs, body.next
            cursor = body.next

    def first(c: CubeletClient) -> tuple[list[Event], int]:
        return page(c, since)

    def picked(evs: list[Event]) -> list[dict[str, Any]]:
        return [_shown(e) for e in evs if _matches(e, device, sandbox, kind, event)]

    if not follow:
        evs, _ = node(first)
        newest = picked(evs)[-limit:][::-1]
        output.emit({"events": newest}, lambda: console.print(event_table(newest)))
        return
    try:
        with output.reaching("Cubelet", node.where, node.fix):
            evs, cursor = first(node.client)
            shown = picked(evs)[-limit:][::-1]
            if output.machine():
                for e in shown[::-1]:
                    print(json.dumps(e), flush=True)
            else:
                console.print(event_table(shown, title="events (newest first; following)"))
            while True:
                time.sleep(0.5)
                evs, cursor = page(node.client, cursor)
                for e in picked(evs):
                    if output.machine():
                        print(json.dumps(e), flush=True)
                    else:
                        console.print(event_table([e], title=""), end="")
    except KeyboardInterrupt:
        pass
    finally:
        node.client.close()


@reservation_app.command("list")
def reservation_list(state_dir: ClientStateDir = None, url: Url = None, as_json: AsJson = False) -> None:
    """Reservations the Cubelet holds: sandbox, phase, devices, since when."""
    from rich.table import Table

    output.json_flag(as_json)
    held: list[Reservation] = _Node(state_dir, url)(lambda c: c.reservations())

    def table() -> None:
        t = Table(title="reservations")
        t.add_column("sandbox", no_wrap=True)
        for col in ("phase", "devices", "expires"):
            t.add_column(col, overflow="fold")
        for r in held:
            t.add_row(r.sandbox_id, output.state(r.phase), ", ".join(r.device_ids) or "-", str(r.expires_at or "-"))
        console.print(t)

    output.emit({"reservations": [_shown(r) for r in held]}, table)


def demo_cmd(profile: Annotated[str, typer.Option(help="simulated devices, when QEMU is missing")] = "h100x2") -> None:
    """A GPU-style sandbox end to end on the embedded single node (`up`, create, delete, `down`)."""
    from cubeaccel.cli.demo import run_demo

    raise typer.Exit(run_demo(profile))


def register_top_level(root: typer.Typer) -> None:
    """Node verbs operators type most (`cubeaccel devices`) live at the top level."""
    root.command("devices")(devices_cmd)
    root.command("device")(device_cmd)
    root.command("events")(events_cmd)
    root.add_typer(reservation_app, name="reservation")
    root.command("demo")(demo_cmd)


@app.command("backup")
def backup_cmd(
    out: Annotated[Path, typer.Argument(help="a new directory for the backup")],
    state_dir: StateDir = DEFAULT_STATE,
) -> None:
    """Back up a (running) Cubelet's store with SQLite's online backup, plus its instance id and audit log."""
    from cubeaccel.cubelet.runtime import INSTANCE_FILE
    from cubeaccel.host.service.backup import backup

    side = [state_dir / n for n in (INSTANCE_FILE, "simulated-host.json", "audit.jsonl")]
    try:
        info = backup(state_dir / "cubelet.db", side, out, "cubelet")
    except CubeError as e:
        _fail(e)
        return
    output.emit(info, lambda: console.print(f"backed up {state_dir} to {out} ({sum(info['rows'].values())} rows)"))


@app.command("restore")
def restore_cmd(
    backup_dir: Annotated[Path, typer.Argument(help="a directory written by `cubeaccel cubelet backup`")],
    state_dir: StateDir = DEFAULT_STATE,
) -> None:
    """Restore a backup into a fresh state directory (refused where a store exists or a Cubelet runs)."""
    from cubeaccel.host.service.backup import restore

    try:
        info = restore(backup_dir, state_dir, "cubelet")
    except CubeError as e:
        _fail(e)
        return
    output.emit(info, lambda: console.print(f"restored {backup_dir} into {state_dir}: start `cubeaccel cubelet serve`"))
