"""`cubeaccel up`: CubeMaster (SQLite in a state dir) + one Cubelet subprocess, on free local ports.

Backend choice, said out loud: `emulated` (QEMU's edu device in real MicroVMs) when QEMU is installed,
KVM can run a stock guest, and a guest image is built; otherwise `simulated` (simulated GPUs, simulated
shim). The example templates are registered as the class defaults: edu-demo for `accelerator`,
cuda12-h100 for `gpu`; and `base` (CPU-only), which E2B's SDK asks for when it names no template.
`--detach` returns once the node is ready and writes `up.json` (URLs and pids) for `cubeaccel sandbox …` and
`cubeaccel down`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from cubeaccel.host.pci.procfs import start_time
from cubeaccel.host.service.childenv import component_env
from cubeaccel.host.vmm.hypervisor import detect_accel, find_qemu
from cubeaccel.model.reservation_states import ReservationPhase
from cubeaccel.model.sandbox_states import SandboxState
from cubeaccel.model.states import DeviceState
from cubeaccel.protocol.errors import CubeError
from cubeaccel.transport.master_client import Calls, MasterClient
from cubeaccel.wire.templates import loads_document

if TYPE_CHECKING:
    from cubeaccel.transport.cubelet_client import CubeletClient

# Package data, so an installed wheel registers them too (not a path into a source checkout).
EXAMPLES = resources.files("cubeaccel") / "examples" / "templates"
DEFAULTS = {"edu-demo.yaml": "accelerator", "cuda12-h100.yaml": "gpu"}
WARM_TEMPLATE = {"emulated": "edu-demo.yaml", "simulated": "cuda12-h100.yaml"}  # what `up`'s warm pool keeps
PINNED_FLAVOUR = "userland"  # what `up` pins edu-demo and base to: a sandbox's shell has E2B base's userland
BY_NAME = ("base.yaml",)  # registered, default for no class: asked for by name (E2B's default templateID)
SIMULATED_PINNABLE_MIB = 1 << 20  # a simulated node advertises 1 TiB lockable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _quiet(_: str) -> None:
    pass


def choose_backend(requested: str, on_phase: Callable[[str], None] = _quiet) -> tuple[str, str]:
    """(backend, why). `emulated` wherever QEMU runs MicroVMs — under TCG too: a sandbox cycle from a
    template snapshot takes ~2 s here (docs/decisions.md) — and the guest image builds; else `simulated`."""
    if requested not in ("auto", "simulated", "emulated"):
        raise CubeError(
            "up.unknown_backend", f"--backend must be auto, simulated or emulated, not {requested!r}", "api", {}, 422
        )
    if requested == "simulated":
        return requested, "asked for with --backend"
    if not find_qemu():
        if requested == "emulated":
            raise CubeError("up.qemu_missing", "--backend emulated needs qemu-system-x86_64", "backend", {}, 422)
        return "simulated", "qemu-system-x86_64 is not installed (`make deps` installs it)"
    from cubeaccel.images.builder import build
    from cubeaccel.images.userland import USERLAND

    try:
        image, fresh = build(on_phase=lambda p: on_phase(f"guest image: {p}"))
        build(on_phase=lambda p: on_phase(f"userland image (E2B's base): {p}"), flavour=USERLAND)
    except CubeError as e:
        if requested == "emulated":
            raise
        return "simulated", f"the guest image could not be built ({e.code}: {e.message})"
    accel, why = detect_accel()
    return "emulated", (
        f"real QEMU MicroVMs with the emulated edu PCI device, accel {accel} ({why}); "
        f"guest kernel {image.kernel_release}, image {'built now' if fresh else 'cached'}"
    )


def _spawn(argv: list[str], log: Path, detach: bool) -> subprocess.Popen[bytes]:
    out = open(log, "ab")  # noqa: SIM115 - the child owns it
    # The services get our settings, never the operator's whole shell (its admin key: issue 30 #6).
    return subprocess.Popen(argv, env=component_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=detach)


def _wait(what: str, fn: Any, deadline_s: float, procs: list[subprocess.Popen[bytes]]) -> Any:
    end = time.monotonic() + deadline_s
    last: object = None
    while time.monotonic() < end:
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"{what}: process {p.pid} exited with {p.returncode}")
        try:
            value = fn()
            if value:
                return value
        except (CubeError, OSError, httpx.HTTPError) as e:
            last = e
        time.sleep(0.1)
    raise RuntimeError(f"{what} not ready within {deadline_s}s ({last})")


def example_document(name: str, directory: Traversable = EXAMPLES, pin_to_image: bool = False) -> dict[str, Any]:
    """An example template as registered; with `pin_to_image`, an emulated or CPU-only one names this host's
    userland image (E2B base's tools: every template a user drives carries them, docs/images.md)."""
    doc = loads_document((directory / name).read_text(), name)
    if not isinstance(doc, dict):
        raise CubeError("template.invalid", f"example template {name} is not a mapping", "template")
    backend = (doc["spec"].get("accelerator") or {}).get("backend", "none")  # none: CPU-only
    if pin_to_image and backend in ("emulated", "none"):
        from cubeaccel.images.builder import latest
        from cubeaccel.images.manifest import pin_template_document

        image = latest(flavour=PINNED_FLAVOUR) or latest()
        if image is not None:
            doc = pin_template_document(doc, image)
    return doc


def register_examples(
    client: MasterClient, directory: Traversable = EXAMPLES, pin_to_image: bool = False
) -> tuple[list[str], dict[str, dict[str, Any]]]:
    """Register the example templates (class defaults, and `base` by name); with `pin_to_image`, edu-demo and
    base name this host's image. Returns what to print, and each document as registered (by file name)."""
    done, docs = [], {}
    for name, cls in [*DEFAULTS.items(), *((n, None) for n in BY_NAME)]:
        if not (directory / name).is_file():
            continue
        docs[name] = register_example(client, example_document(name, directory, pin_to_image), cls is not None)
        done.append(f"{name.removesuffix('.yaml')}" + (f" (default for {cls})" if cls else ""))
    return done, docs


def register_example(client: MasterClient, doc: dict[str, Any], default: bool) -> dict[str, Any]:
    """Register `doc`; where its version is taken by another document (the state dir of an earlier `up`, before
    an upgrade or a re-pin changed the example), as the version `<version>.<12 hex of the document>`: the same
    document gets the same version on every later `up`, and sandboxes of the old one keep theirs."""
    try:
        client.register_template(doc, default=default)
        return doc
    except CubeError as e:
        if e.code != "template.version_exists":
            raise
    meta = doc["metadata"]
    digest = hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:12]
    doc = {**doc, "metadata": {**meta, "version": f"{meta['version']}.{digest}"}}
    client.register_template(doc, default=default)
    return doc


def warm_pool_file(
    state_dir: Path, backend: str, size: int, registered: dict[str, dict[str, Any]]
) -> tuple[list[str], str]:
    """`cubelet serve` flags for `up`'s warm pool and the line `up` prints about it: `size` sandboxes of the
    default template of the class this backend serves (edu-demo on real MicroVMs, cuda12-h100 simulated),
    written as registered (`registered`: by file name) so the pool's contract is the one CubeMaster's creates
    carry."""
    if size == 0:
        return [], "warm pool: off (--warm 0)"
    name = WARM_TEMPLATE[backend]
    doc = registered.get(name) or example_document(name, pin_to_image=backend == "emulated")
    path = state_dir / f"warm-{name}"
    path.write_text(json.dumps(doc))
    memory = doc["spec"]["memory"]
    pins = f"pins {size * memory['size_mib']} MiB" if memory.get("pinned") else "pins nothing"
    why = f"warm pool: {size} x {name.removesuffix('.yaml')} kept started ({pins}; --warm 0 turns it off)"
    return ["--warm", f"{path}={size}"], why


def running(state_dir: Path) -> dict[str, Any] | None:
    """The stack `up.json` describes, if its processes are alive and its CubeMaster answers; else None."""
    try:
        info = json.loads((state_dir / "up.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(info, dict) or not info.get("pids") or not all(_ours(p) for p in _listed(info)):
        return None
    c = MasterClient(str(info["master_url"]), timeout=5.0)
    try:
        c.health()
    except (CubeError, httpx.HTTPError):
        return None
    finally:
        c.close()
    return info


def _report_running(info: dict[str, Any]) -> None:
    print(
        f"already running: CubeMaster {info['master_url']}, Cubelet {info['cubelet_url']} "
        f"(backend {info['backend']}, pids {', '.join(str(p) for p in info['pids'])}); "
        f"nothing started. Stop it with `cubeaccel down --state-dir {info['state_dir']}`"
    )


def run_up(
    state_dir: Path,
    backend: str,
    profile: str,
    detach: bool,
    on_phase: Callable[[str], None] = _quiet,
    warm: int = 0,
) -> int:
    """Start the stack, or — when one already runs on `state_dir` — say so and start nothing.

    `up.lock` is held while starting (and for a foreground `up`'s whole life), so two `up`s racing on one
    directory never start two pairs; the second waits for the first's `up.json` and reports it. CubeMaster and
    the Cubelet also lock their own state (`master.lock`, `cubelet/cubelet.lock`): a stack started some other
    way on this directory makes this one fail instead of running beside it."""
    from cubeaccel.host.service import statelock

    if (info := running(state_dir)) is not None:
        _report_running(info)
        return 0
    try:
        lock = statelock.acquire(state_dir, "up")
    except CubeError as e:
        end = time.monotonic() + 120  # another `up` is starting here: report its stack once it is up
        while time.monotonic() < end:
            if (info := running(state_dir)) is not None:
                _report_running(info)
                return 0
            if statelock.holder(state_dir / "up.lock") is None:
                break
            time.sleep(0.2)
        print(f"error {e.code}: {e.message}", file=sys.stderr)
        return statelock.LOCKED_EXIT
    try:
        return _up_locked(state_dir, backend, profile, detach, on_phase, warm)
    finally:
        lock.release()


def _up_locked(
    state_dir: Path, backend: str, profile: str, detach: bool, on_phase: Callable[[str], None], warm: int
) -> int:
    if (info := running(state_dir)) is not None:  # started between our check and our lock
        _report_running(info)
        return 0
    stale = state_dir / "up.json"
    if stale.exists():  # a stack that died (or was killed): what is left of it is stopped, then started afresh
        with contextlib.suppress(OSError, ValueError, KeyError):
            _stop(_listed(json.loads(stale.read_text())))
        stale.unlink(missing_ok=True)
    try:
        on_phase("choosing the backend")
        chosen, why = choose_backend(backend, on_phase)
    except CubeError as e:
        print(f"error {e.code}: {e.message}", file=sys.stderr)
        return 2
    on_phase("starting CubeMaster")
    state_dir.mkdir(parents=True, exist_ok=True)
    mport, cport = free_port(), free_port()
    murl = f"http://127.0.0.1:{mport}"
    py = [sys.executable, "-m", "cubeaccel"]
    master = _spawn(
        [
            *py,
            "master",
            "serve",
            "--db",
            str(state_dir / "master.db"),
            "--state-dir",
            str(state_dir),
            "--listen",
            f"127.0.0.1:{mport}",
            "--audit-log",
            str(state_dir / "audit.jsonl"),
            "--bootstrap",
            str(state_dir),
        ],
        state_dir / "master.log",
        detach,
    )
    cub_argv = [
        *py,
        "cubelet",
        "serve",
        "--backend",
        chosen,
        "--state-dir",
        str(state_dir / "cubelet"),
        "--listen",
        f"127.0.0.1:{cport}",
        "--master",
        murl,
        "--node",
        "local",
        "--node-token-file",
        str(state_dir / "node-local.token"),
        "--warm-reset",  # this stack owns its node: `down` drained the last run's pools; `--warm` says this one's
    ]
    if chosen == "simulated":
        cub_argv += ["--profile", profile, "--pinnable-memory-mib", str(SIMULATED_PINNABLE_MIB)]
    procs = [master]
    client = MasterClient(murl)
    try:
        _wait("CubeMaster", client.health, 30, procs)
        on_phase("registering the example templates")
        admin = (state_dir / "admin.key").read_text().strip()  # written 0600 by CubeMaster's first start
        client.close()
        client = MasterClient(murl, key=admin)
        token = client.call(Calls.enrol("local")).token
        _write_secret(state_dir / "node-local.token", token)
        registered, documents = register_examples(client, pin_to_image=chosen == "emulated")
        warm_flags, warm_line = warm_pool_file(state_dir, chosen, warm, documents)
        cub_argv += warm_flags
        on_phase(f"starting the Cubelet ({chosen}) and waiting for it to register")
        spawned = time.time()
        procs.append(_spawn(cub_argv, state_dir / "cubelet.log", detach))

        def registered_now() -> bool:
            # A heartbeat from this Cubelet, not the node row an earlier run (or a restored backup) left `ready`.
            return any(
                n.node == "local" and n.state == "ready" and n.last_heartbeat_age_s <= time.time() - spawned
                for n in client.nodes()
            )

        _wait("node registration", registered_now, 60, procs)
    except (RuntimeError, CubeError, httpx.HTTPError) as e:
        print(f"error: {e}; logs in {state_dir}", file=sys.stderr)
        _stop(_started(procs))
        return 1
    except BaseException:
        _stop(_started(procs))
        raise
    on_phase("")  # started: the live phases end here, before the summary on stdout
    info = {
        "master_url": murl,
        "cubelet_url": f"http://127.0.0.1:{cport}",
        "backend": chosen,
        "why": why,
        "pids": [p.pid for p in procs],
        "starts": [start for _, start in _started(procs)],  # each pid's start time: pid reuse is told apart
        "state_dir": str(state_dir),
    }
    (state_dir / "up.json").write_text(json.dumps(info, indent=2))
    node = client.nodes()[0]
    print(f"backend: {chosen} — {why}")
    print(
        f"CubeMaster {murl} (SQLite {state_dir / 'master.db'}); node {node.node}: "
        f"{node.allocatable}/{node.total} devices free"
    )
    print("templates: " + (", ".join(registered) or f"none found in {EXAMPLES}"))
    print(warm_line)
    for t in client.call(Calls.templates()).templates:
        need = client.call(Calls.template(t.name)).document["spec"]["memory"]
        if t.default and need["pinned"] and need["size_mib"] > node.pinnable_memory_mib:
            print(
                f"note: {t.name} pins {need['size_mib']} MiB and this node can lock "
                f"{node.pinnable_memory_mib} MiB: its sandboxes will be refused with pinned_memory"
            )
    print(f"keys (0600): admin {state_dir / 'admin.key'}, tenant default {state_dir / 'default.key'}")
    print(
        f"try: CUBEACCEL_MASTER={murl} CUBEACCEL_API_KEY=$(cat {state_dir / 'default.key'}) "
        "cubeaccel sandbox create --gpu "
        f"{'H100:1' if chosen == 'simulated' else 'accelerator:1'}"
    )
    if detach:
        return 0
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    signal.sigwait({signal.SIGINT, signal.SIGTERM})  # foreground until Ctrl-C or SIGTERM
    _report_left(end_sandboxes(murl, f"http://127.0.0.1:{cport}", state_dir))
    _stop(_started(procs))
    (state_dir / "up.json").unlink(missing_ok=True)
    return 0


def _write_secret(path: Path, value: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")


def _secret(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def end_sandboxes(master_url: str, cubelet_url: str, state_dir: Path, deadline_s: float = 60.0) -> list[str]:
    """End every sandbox `up` served, through the release path, before its daemons stop: a stopped Cubelet
    leaves its shims and VMMs (and their pinned memory) running. Drains the Cubelet's warm pools first (their
    sandboxes enter the release path at once and none is started again), then deletes each sandbox at CubeMaster, then
    releases whatever the Cubelet still holds (a sandbox CubeMaster never recorded included) and waits until
    it holds nothing and no released device is still being scrubbed (a scrub VM outliving its Cubelet would run
    unrecorded, beside the next start's reconcile scrubbing the same device). Returns the sandbox ids still
    held at the deadline."""
    from cubeaccel.transport.cubelet_client import CubeletClient

    c = CubeletClient(url=cubelet_url, timeout=10.0, token=_secret(state_dir / "node-local.token"))
    with contextlib.suppress(CubeError, httpx.HTTPError):  # warm ones first, and no refill behind the release
        c.warm_drain()
    m = MasterClient(master_url, timeout=10.0, key=_secret(state_dir / "admin.key"))
    try:
        rows = m.sandboxes()
    except (CubeError, httpx.HTTPError):
        rows = []
    for row in rows:
        if row.state not in (SandboxState.DELETED, SandboxState.DELETING):
            with contextlib.suppress(CubeError, httpx.HTTPError):
                m.delete(row.id)
    m.close()
    end = time.monotonic() + deadline_s
    held: list[str] = []
    try:
        while True:
            try:
                reservations = c.reservations()
                cleaning = scrubbing(c)
            except (CubeError, httpx.HTTPError):
                return held  # no Cubelet to ask: nothing more this command can end
            held = [r.sandbox_id for r in reservations]
            if (not held and not cleaning) or time.monotonic() > end:
                return held
            for r in reservations:
                if r.phase is not ReservationPhase.RELEASING:
                    with contextlib.suppress(CubeError, httpx.HTTPError):
                        c.release(r.sandbox_id)
            time.sleep(0.2)
    finally:
        c.close()


def scrubbing(c: CubeletClient) -> list[str]:
    """Devices between a tenant and the next one: released and not yet scrubbed (the Cubelet's scrub runs)."""
    return [d.id for d in c.devices() if d.state in (DeviceState.RELEASING, DeviceState.RELEASED)]


def _report_left(held: list[str]) -> None:
    if held:
        print(f"warning: still held after the release timeout, stopping anyway: {', '.join(held)}")


Started = tuple[int, int | None]  # a pid and its start time (clock ticks after boot)


def _started(procs: list[subprocess.Popen[bytes]]) -> list[Started]:
    return [(p.pid, start_time(p.pid)) for p in procs]


def _listed(info: dict[str, Any]) -> list[Started]:
    """The processes an `up.json` names. One written before start times were recorded names none that can be
    verified: its pids are never signalled (a stale file's pid may be anyone's by now)."""
    pids = [int(p) for p in info.get("pids", [])]
    starts = info.get("starts")
    if not isinstance(starts, list) or len(starts) != len(pids):
        return [(pid, None) for pid in pids]
    return [(pid, int(s) if isinstance(s, int) else None) for pid, s in zip(pids, starts, strict=True)]


def _ours(p: Started) -> bool:
    """The very process `up` started: alive with the start time recorded with its pid (issue 30 #9). A pid
    reused by another process — whatever its command line — is not ours."""
    pid, start = p
    return start is not None and start_time(pid) == start


def _stop(procs: list[Started]) -> None:
    for p in reversed(procs):
        if _ours(p):
            with contextlib.suppress(ProcessLookupError):
                os.kill(p[0], signal.SIGTERM)
    end = time.monotonic() + 10
    while time.monotonic() < end and any(_ours(p) for p in procs):
        time.sleep(0.1)
    for p in procs:
        if _ours(p):
            with contextlib.suppress(ProcessLookupError):
                os.kill(p[0], signal.SIGKILL)


def run_down(state_dir: Path) -> int:
    up = state_dir / "up.json"
    if not up.exists():
        print(f"nothing to stop: no {up}")
        return 0
    info = json.loads(up.read_text())
    _report_left(end_sandboxes(info["master_url"], info["cubelet_url"], state_dir))
    _stop(_listed(info))
    up.unlink()
    print(f"stopped CubeMaster and Cubelet ({info['master_url']})")
    return 0
