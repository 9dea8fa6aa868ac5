"""The composition root: the one place a Cubelet is made, whole, with every part it uses.

`assemble` wires given parts (the journal and its custody audit, the release path with its scrub runner, status
sink and host audit, then the Cubelet, which builds the warm pools and metrics that read it); `build_cubelet`
first chooses the store, backend, host and shim driver from command-line options; `build_served` adds what a served
node runs beside it (metrics, the status push that is its sink, the heartbeat). Nothing is attached to a Cubelet
after this: a part it lacks here, it lacks for good."""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from cubeaccel.backends.base import Backend, Capabilities
from cubeaccel.cubelet.device_audit import DeviceAudit
from cubeaccel.cubelet.ended import EndedSandboxes
from cubeaccel.cubelet.journal import Journal
from cubeaccel.cubelet.lifecycle import Cubelet, CubeletConfig
from cubeaccel.cubelet.locks import KeyedLocks
from cubeaccel.cubelet.metrics import CubeletMetrics
from cubeaccel.cubelet.release import ReleasePath, StatusSink
from cubeaccel.cubelet.scrub import ScrubRunner, SimulatedScrubRunner, UnavailableScrubRunner
from cubeaccel.cubelet.shim_driver import ShimDriver, SimulatedShimDriver
from cubeaccel.cubelet.store import Store
from cubeaccel.host.service.audit import AuditLog
from cubeaccel.model.node_facts import GuestImageFact, parse_guest_images
from cubeaccel.protocol.errors import invalid

if TYPE_CHECKING:  # httpx, which the lab guest's Cubelet closure lacks: imported where a served node is built
    from cubeaccel.cubelet.heartbeat import Heartbeat
    from cubeaccel.cubelet.status_push import StatusPush

BACKENDS = ("simulated", "vfio", "emulated")
SIMULATED_ALLOW = ("10de:*", "1234:11e8")


@dataclass(frozen=True)
class RuntimeOptions:
    state_dir: Path
    backend: str = "simulated"
    profile: str = "h100x8"
    sysfs_root: Path = Path("/sys")
    dev_root: Path = Path("/dev")  # host readiness only (fake trees in tests); holders are always read in /proc
    proc_root: Path = Path("/proc")
    allow: tuple[str, ...] = ("10de:*",)
    config: CubeletConfig = field(default_factory=CubeletConfig)
    vm_start: str = "template"  # real shims: start from the template snapshot, or cold boot
    shim_launch: str = "fork"  # real shims: forked from the shim fork server (spawned when it cannot), or spawned
    detach_timeout_s: float = 10.0  # real shims: how long to wait for DEVICE_DELETED
    holder_scan_exempt_pids: frozenset[int] = frozenset()  # vfio: unreadable processes declared harmless
    guest_images: Path | None = None  # simulated nodes: a JSON list of guest images replacing the default set
    scrub_image: str | None = None  # real nodes: the scrub VM's guest image digest (None: the newest built)
    emulated_devices: int = 2  # emulated nodes: how many edu stand-ins
    memory_devices: tuple[int, ...] = ()  # emulated nodes: ivshmem-plain stand-ins (bytes each), files kept
    testdev_membars: tuple[int, ...] = ()  # emulated nodes: pci-testdev stand-ins, their BAR2 sizes (GPU-shaped)


INSTANCE_FILE = "instance-id"


def instance_id(state_dir: Path) -> str:
    """This Cubelet's instance id: made once per state dir, the same after every restart of it.

    Devices that exist only for this Cubelet (emulated ones) carry it in their ids, so another Cubelet on the
    same host — another test run, a demo — never takes this one's VMMs for holders of its own devices.
    """
    path = state_dir / INSTANCE_FILE
    if not path.exists():
        tmp = state_dir / f".{INSTANCE_FILE}.{os.getpid()}"
        tmp.write_text(uuid.uuid4().hex[:8] + "\n")
        with contextlib.suppress(FileExistsError):
            os.link(tmp, path)  # complete or absent, never half-written; the first writer wins
        tmp.unlink()
    from cubeaccel.backends.emulated import INSTANCE_RE

    found = path.read_text().strip()
    if not INSTANCE_RE.fullmatch(found):
        raise invalid(
            "cubelet.invalid_instance_id",
            f"{path} holds {found[:40]!r}, not an instance id",
            layer="cubelet",
            path=str(path),
        )
    return found


def _guest_images(path: Path) -> tuple[GuestImageFact, ...]:
    try:
        return parse_guest_images(json.loads(path.read_text()))
    except (OSError, ValueError) as e:
        raise invalid("cubelet.invalid_guest_images", f"{path}: {e}") from e


def assemble(
    store: Store,
    backend: Backend,
    shim: ShimDriver,
    config: CubeletConfig | None = None,
    *,
    scrub_runner: ScrubRunner | None = None,
    audit: AuditLog | None = None,
    status_sink: StatusSink | None = None,
) -> Cubelet:
    """A Cubelet from its parts. `scrub_runner` None: the simulated node plays its scrub VMs as it plays its
    sandboxes' VMs; any other node without a runner fails every scrub it owes (quarantine), never skips one.
    `audit`: host changes made for sandboxes and each device's custody go there (None: neither is audited, as
    in unit tests). `status_sink`: where sandbox status goes to CubeMaster (None: a node without one)."""
    config = config or CubeletConfig()
    device_audit = None if audit is None else DeviceAudit(audit, config.node_name)
    if device_audit is not None:
        store.listeners.append(device_audit)  # each device's custody (who had it), from the store's own events
    journal = Journal(store, device_audit)
    capabilities = Capabilities.of(backend)  # checked once; call sites never probe the backend
    device_locks, ended = KeyedLocks(), EndedSandboxes()
    if scrub_runner is None:
        simulated = isinstance(shim, SimulatedShimDriver)
        scrub_runner = SimulatedScrubRunner() if simulated else UnavailableScrubRunner()
    release_path = ReleasePath(
        journal,
        backend,
        capabilities,
        shim,
        config,
        device_locks=device_locks,
        ended=ended,
        scrub_runner=scrub_runner,
        status_sink=status_sink,
        audit=audit,
    )
    return Cubelet(journal, backend, capabilities, shim, config, release_path, device_locks=device_locks, ended=ended)


def build_cubelet(
    opts: RuntimeOptions, *, audit: AuditLog | None = None, status_sink: StatusSink | None = None
) -> Cubelet:
    """The Cubelet the options describe; `audit` and `status_sink` as in `assemble`."""
    if opts.vm_start not in ("template", "cold"):
        raise invalid("cubelet.invalid_vm_start", f"--vm-start must be template or cold, not {opts.vm_start!r}")
    if opts.shim_launch not in ("fork", "spawn"):
        raise invalid("cubelet.invalid_shim_launch", f"--shim-launch must be fork or spawn, not {opts.shim_launch!r}")
    if opts.backend not in BACKENDS:
        raise invalid(
            "cubelet.unknown_backend", f"unknown backend {opts.backend!r}; known: {list(BACKENDS)}", layer="backend"
        )
    if opts.guest_images is not None and opts.backend != "simulated":
        raise invalid(
            "cubelet.guest_images_simulated_only",
            "--guest-images sets a simulated node's images; real "
            "nodes report the images in their cache (`cubeaccel image build`)",
        )
    opts.state_dir.mkdir(parents=True, exist_ok=True)
    opts.state_dir.chmod(0o700)  # the unix socket in it carries shim reports and operator verbs
    store = Store(opts.state_dir / "cubelet.db")
    backend: Backend
    shim: ShimDriver
    if opts.backend == "simulated":
        from cubeaccel.backends.vfio import VfioBackend
        from cubeaccel.host.pci.simulated import SimulatedPciHost

        host = SimulatedPciHost(opts.profile, opts.state_dir / "simulated-host.json")
        backend = VfioBackend(host, allow=SIMULATED_ALLOW)
        shim = (
            SimulatedShimDriver(host)
            if opts.guest_images is None
            else SimulatedShimDriver(host, guest_images=_guest_images(opts.guest_images))
        )
    elif opts.backend == "vfio":
        from cubeaccel.backends.vfio import VfioBackend
        from cubeaccel.cubelet.process_shim import ProcessShimDriver
        from cubeaccel.host.pci.readiness import HostRoots
        from cubeaccel.host.pci.sysfs import SysfsPciHost

        roots = HostRoots(opts.sysfs_root, opts.dev_root, opts.proc_root)
        backend = VfioBackend(
            SysfsPciHost(str(opts.sysfs_root), exempt_pids=opts.holder_scan_exempt_pids),
            allow=opts.allow,
            readiness_roots=roots,
        )
        shim = ProcessShimDriver(
            opts.state_dir,
            start_mode=opts.vm_start,
            detach_timeout_s=opts.detach_timeout_s,
            launch=opts.shim_launch,
        )
    else:
        from cubeaccel.backends.emulated import EmulatedBackend
        from cubeaccel.cubelet.process_shim import ProcessShimDriver
        from cubeaccel.host.vmm.confine import ConfinePolicy

        backend = EmulatedBackend(
            instance_id(opts.state_dir),
            slots=opts.emulated_devices,
            memory_devices=opts.memory_devices,
            testdev_membars=opts.testdev_membars,
            memory_dir=(opts.state_dir / "device-memory").absolute(),
            vmm_root=(opts.state_dir / "shims").absolute(),
            uid=os.getuid(),
            vmm_uids=ConfinePolicy.from_env().uids,
        )
        shim = ProcessShimDriver(
            opts.state_dir,
            start_mode=opts.vm_start,
            detach_timeout_s=opts.detach_timeout_s,
            launch=opts.shim_launch,
        )
    runner = None
    if opts.backend != "simulated":
        from cubeaccel.cubelet.scrub import ProcessScrubRunner

        runner = ProcessScrubRunner(
            opts.state_dir, opts.vm_start, opts.scrub_image, detach_timeout_s=opts.detach_timeout_s
        )
    return assemble(store, backend, shim, opts.config, scrub_runner=runner, audit=audit, status_sink=status_sink)


@dataclass(frozen=True)
class MasterLink:
    """`--master`: the CubeMaster this node reports to, how CubeMaster reaches this Cubelet, how often it reports,
    and the node token every heartbeat and status push is signed with."""

    master_url: str
    cubelet_url: str
    interval_s: float
    token: Callable[[], str | None] | None = None


@dataclass(frozen=True)
class ServedCubelet:
    """What `cubeaccel cubelet serve` runs: the Cubelet, the metrics both listeners serve, its audit log, and with
    a CubeMaster the status push (its sink, started once the node is up) and the heartbeat (started once serving)."""

    cubelet: Cubelet
    metrics: CubeletMetrics
    audit: AuditLog
    status_push: StatusPush | None
    heartbeat: Heartbeat | None


def build_served(opts: RuntimeOptions, *, audit: AuditLog, master: MasterLink | None) -> ServedCubelet:
    """The served node: its Cubelet, built with the audit log and (with a CubeMaster) the status push as its sink;
    the metrics, counting from the first event (the host's initialization, which follows); the heartbeat. Nothing
    is started here."""
    from cubeaccel.cubelet.heartbeat import Heartbeat
    from cubeaccel.cubelet.status_push import StatusPush

    push = None if master is None else StatusPush(master.master_url, opts.config.node_name, token=master.token)
    cubelet = build_cubelet(opts, audit=audit, status_sink=None if push is None else push.push)
    heartbeat = (
        None
        if master is None
        else Heartbeat(cubelet, master.master_url, master.cubelet_url, master.interval_s, token=master.token)
    )
    return ServedCubelet(cubelet, CubeletMetrics(cubelet), audit, push, heartbeat)
