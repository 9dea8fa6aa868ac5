"""GPU-capable templates: boot once without any device, pause, save to a file; sandboxes restore from it.

The template's machine (memory size, vCPUs, root ports and their windows, accel, image) is part of its key, so a
restored sandbox always has the machine its state was saved from. The template VM never has a device attached
(`QemuVmm.save_state` refuses), and its memory is not locked — each sandbox preallocates and locks its own.

A snapshot is made by `prepare_template` only: for each plan the Cubelet derives from what it serves and its
devices' BARs (cubelet/snapshots.py, run as `cubeaccel template prepare --plan`), or by hand. A sandbox's start
only looks one up (`template_lease`): building one took a tenant's start ~49 s for 256 MiB under load, and
grows with the guest. A start that finds none boots cold and says why (`start.cold_no_snapshot`, and
`snapshot_lookup`: the nearest prepared machine and the fields that differ).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

from cubeaccel.host.vmm.hypervisor import detect_accel, host_cpus, numa_nodes
from cubeaccel.images.builder import prune
from cubeaccel.images.manifest import Manifest
from cubeaccel.model.bars import Bar, human_bytes
from cubeaccel.model.start_deadlines import BASE_S, start_deadlines
from cubeaccel.shim.agent_client import AgentClient
from cubeaccel.shim.machine import vm_config
from cubeaccel.shim.qemu import QemuVmm, qemu_binary
from cubeaccel.shim.vmm import VmConfig
from cubeaccel.wire.shim_spec import ShimSpec
from cubeaccel.wire.snapshot import SnapshotLookup

KEEP_TEMPLATES = 4  # each saved state is about the guest's touched RAM (~150 MB for 256 MiB guests)


def machine_doc(cfg: VmConfig, manifest: Manifest, accel: str) -> dict[str, Any]:
    """Everything a saved state depends on, by field: hashed into the key, kept in the state's `meta.json` so a
    start that finds no state can say which fields differ from the nearest one."""
    qemu = Path(qemu_binary())
    st = qemu.stat()
    return {
        "image": manifest.image_digest,
        "cmdline": cfg.cmdline,
        "memory_mib": cfg.memory_mib,
        "vcpus": cfg.vcpus,
        "root_ports": cfg.root_ports,
        "shape": cfg.machine.to_json(),
        "memory_backend": cfg.memory_backend,
        "accel": accel,
        "qemu": [str(qemu), st.st_size, int(st.st_mtime)],
    }


def _key_of(doc: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]


def template_key(cfg: VmConfig, manifest: Manifest, accel: str) -> str:
    return _key_of(machine_doc(cfg, manifest, accel))


PRUNE_LOCK = ".prune.lock"  # in the templates root: restores hold it shared, pruning exclusive


@contextmanager
def _root_lock(root: Path, mode: int) -> Iterator[None]:
    root.mkdir(parents=True, exist_ok=True)
    with (root / PRUNE_LOCK).open("a") as lock:
        fcntl.flock(lock, mode)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@contextmanager
def template_lease(cfg: VmConfig, manifest: Manifest, root: Path) -> Iterator[Path | None]:
    """The saved state for this machine, or None when none was prepared; never builds one.

    While the `with` body runs (the caller's restore reads the state), pruning cannot delete it: the lease is a
    shared lock on the templates root that pruning needs exclusively.
    """
    with _root_lock(root, fcntl.LOCK_SH):
        state = root / template_key(cfg, manifest, detect_accel()[0]) / "state"
        yield state if state.is_file() else None


def snapshot_lookup(cfg: VmConfig, manifest: Manifest, root: Path, found: Path | None) -> SnapshotLookup:
    """What a template start reports of its lookup (`found`: the state it restores, None: it boots cold): the
    plans the state was prepared for, or why none of the node's states is this machine's."""
    doc = machine_doc(cfg, manifest, detect_accel()[0])
    key = _key_of(doc)
    metas = _prepared_metas(root)
    if found is not None:
        return SnapshotLookup(key=key, prepared_for=_labels(metas.get(key, {})), prepared=len(metas))
    scored = sorted(
        (sorted(k for k in doc.keys() | m["machine"].keys() if doc.get(k) != m["machine"].get(k)), k2)
        for k2, m in metas.items()
        if isinstance(m.get("machine"), dict)
    )
    if not scored:
        why = f"{len(metas)} prepared, none records its machine" if metas else "no template snapshot is prepared here"
        return SnapshotLookup(key=key, prepared=len(metas), why=why)
    differs, nearest = scored[0]
    labels = "; ".join(_labels(metas[nearest])) or "an unnamed shape"
    why = f"{len(metas)} prepared, none of this machine: the nearest ({labels}) differs in {', '.join(differs)}"
    if "shape" in differs:
        why += f" (root port window {_widest(doc['shape'])} here, {_widest(metas[nearest]['machine']['shape'])} there)"
    return SnapshotLookup(key=key, prepared=len(metas), nearest=nearest, differs=tuple(differs), why=why)


def _labels(meta: dict[str, Any]) -> tuple[str, ...]:
    found = meta.get("prepared_for")
    return tuple(x for x in found if isinstance(x, str)) if isinstance(found, list) else ()


def _widest(shape: Any) -> str:
    ports = shape.get("ports") if isinstance(shape, dict) else None
    sizes = (
        [p[0] for p in ports if isinstance(p, list) and p and isinstance(p[0], int)] if isinstance(ports, list) else []
    )
    return human_bytes(max(sizes)) if sizes else "unknown"


def _prepared_metas(root: Path) -> dict[str, dict[str, Any]]:
    """The node's prepared states by key (their `meta.json`; a state without a readable one counts, unnamed)."""
    out: dict[str, dict[str, Any]] = {}
    for state in root.glob("*/state") if root.is_dir() else ():
        try:
            meta = json.loads((state.parent / "meta.json").read_text())
        except (OSError, ValueError):
            meta = {}
        out[state.parent.name] = meta if isinstance(meta, dict) else {}
    return out


def prepare_template(
    cfg: VmConfig, manifest: Manifest, root: Path, boot_timeout_s: float = BASE_S, prepared_for: str | None = None
) -> tuple[Path, bool]:
    """The saved state for this machine, made now when missing, and whether it was: off any tenant's path.
    `prepared_for` (a plan's label) is recorded in its `meta.json`, so a start names what it restored."""
    with _root_lock(root, fcntl.LOCK_SH):
        state, created = _ensure(cfg, manifest, root, boot_timeout_s, prepared_for)
    if created:
        prune_templates(root, protect=state.parent.name)
    return state, created


def shape_spec(
    memory_mib: int,
    vcpus: int,
    state_dir: Path,
    memory_backend: str = "ram",
    template_bars: tuple[tuple[Bar, ...], ...] = (),
) -> ShimSpec:
    """A template start's spec with no device: restored sandboxes' root ports fit the widest of `template_bars`
    (the BAR layouts their own specs will carry, model/snapshot_layouts.py)."""
    return ShimSpec(
        sandbox_id="template-shape",
        memory_mib=memory_mib,
        vcpus=vcpus,
        memory_backend=memory_backend,  # type: ignore[arg-type]
        state_dir=state_dir,
        start="template",
        template_bars=template_bars,
    )


def shape_config(
    manifest: Manifest,
    memory_mib: int,
    vcpus: int,
    state_dir: Path,
    memory_backend: str = "ram",
    template_bars: tuple[tuple[Bar, ...], ...] = (),
) -> VmConfig:
    """A machine shape as the sandboxes of that shape will have it on this host (shim/machine.py)."""
    spec = shape_spec(memory_mib, vcpus, state_dir, memory_backend, template_bars)
    return vm_config(spec, manifest, host_cpus(), numa_nodes())


def prune_templates(root: Path, keep: int = KEEP_TEMPLATES, protect: str = "", wait_s: float = 0.0) -> list[str] | None:
    """Keep the `keep` most recent states; None (nothing removed) when a restore held them for `wait_s`.

    Pruning is housekeeping: a creator tries once and leaves it to the next one rather than delay its sandbox.
    """
    root.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + wait_s
    with (root / PRUNE_LOCK).open("a") as lock:
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    return None
                time.sleep(0.05)
        try:
            return prune(root, keep=keep, protect=protect)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _ensure(
    cfg: VmConfig, manifest: Manifest, root: Path, boot_timeout_s: float, prepared_for: str | None
) -> tuple[Path, bool]:
    doc = machine_doc(cfg, manifest, detect_accel()[0])
    key = _key_of(doc)
    tdir = root / key
    state = tdir / "state"
    tdir.mkdir(parents=True, exist_ok=True)
    with (tdir / ".lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if state.exists():
            _add_label(tdir / "meta.json", prepared_for)
            return state, False
        run_dir = tdir / f"build-{os.getpid()}"
        tcfg = replace(cfg, sandbox_id=f"template-{key}", state_dir=run_dir, pin_memory=False, device_ids=())
        deadlines = start_deadlines(cfg.memory_mib, boot_timeout_s, manifest.initrd_bytes())
        vmm = QemuVmm(tcfg, deadlines=deadlines)
        t0 = time.monotonic()
        try:
            vmm.start()
            vmm.verify_confined()  # the template VM is confined like any other (no device, so no capabilities)
            agent = AgentClient(run_dir / "agent.sock")
            agent.connect(10.0)
            hello = agent.wait_hello(deadlines.guest_ready_s)
            agent.close()  # the guest sees the host leave before it is frozen; sandboxes reconnect
            vmm.save_state(state)
            os.chmod(state, 0o600)  # guest memory: QEMU creates the file with its own mode
        finally:
            vmm.stop(5.0)
        meta = {
            "key": key,
            "image_digest": manifest.image_digest,
            "memory_mib": cfg.memory_mib,
            "vcpus": cfg.vcpus,
            "accel": vmm.accel,
            "kernel_release": hello.kernel_release,
            "build_s": round(time.monotonic() - t0, 3),
            "state_bytes": state.stat().st_size,
            "machine": doc,
            "prepared_for": [prepared_for] if prepared_for else [],
        }
        (tdir / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        shutil.rmtree(run_dir, ignore_errors=True)
    return state, True


def _add_label(path: Path, prepared_for: str | None) -> None:
    """Another plan with the same machine (two templates of one image and size) shares the state: named too."""
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    labels = meta.get("prepared_for") if isinstance(meta, dict) else None
    if prepared_for and isinstance(labels, list) and prepared_for not in labels:
        meta["prepared_for"] = [*labels, prepared_for]
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(meta, indent=2) + "\n")
        os.replace(tmp, path)
