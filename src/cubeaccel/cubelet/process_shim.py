"""ShimDriver for the real shim: one `cubeaccel shim run` process per sandbox.

Reports arrive over the Cubelet API (`POST /v1/shim-reports` on the unix socket). Liveness is
learned from the host, never from memory: the shim by its argv in /proc, and the VMM by the
`cubeaccel-sandbox=<id>` tag on its command line — so a restarted Cubelet finds both. Only processes whose files
lie under this Cubelet's `shims/` directory are its own: another Cubelet on the host may use the same sandbox id.
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
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import ValidationError

from cubeaccel.cubelet import runfiles
from cubeaccel.cubelet.shim_driver import NodeFacts, ReportSink, ShimStatus
from cubeaccel.cubelet.shim_forkserver import ForkServer
from cubeaccel.host.service.childenv import component_env
from cubeaccel.host.service.unix_path import connect_path
from cubeaccel.host.vmm.hypervisor import hotplug_paths
from cubeaccel.host.vmm.vmmproc import find_shim, find_vmm
from cubeaccel.images.builder import cache_dir, cached_images, find_image, hold_image, label_of
from cubeaccel.images.manifest import Manifest
from cubeaccel.model.node_facts import MAX_IMAGES, GuestImageFact
from cubeaccel.protocol.errors import CubeError
from cubeaccel.protocol.reports import ShimReport
from cubeaccel.wire import json_guard
from cubeaccel.wire.reports import parse_report
from cubeaccel.wire.shim_spec import MAX_DEVICES as SHIM_MAX_DEVICES
from cubeaccel.wire.shim_spec import SHIM_LIMITS, ShimSpec, spec_error
from cubeaccel.wire.snapshot import SnapshotPlan

if TYPE_CHECKING:
    from cubeaccel.cubelet.snapshots import DoneFn
from cubeaccel.wire.warm import MAX_CONTROL_LINE, ShimClaim, ShimClaimAck

CONTROL_SOCKET = "control.sock"  # a warm shim's claim socket (shim/warm_control.py: the same name)
_Signature = tuple[tuple[int, int], ...]
LAUNCH_MODES = ("fork", "spawn")


class ProcessShimDriver:
    max_devices = SHIM_MAX_DEVICES
    host_devices = True

    def __init__(
        self,
        state_dir: Path,
        python: str = sys.executable,
        proc: Path = Path("/proc"),
        start_mode: str = "template",
        detach_timeout_s: float = 10.0,
        launch: str = "fork",
    ) -> None:
        """`launch`: "fork" asks the shim fork server first (spawning when it cannot), "spawn" always spawns."""
        self.dir = (state_dir / "shims").absolute()  # the prefix its processes' argv is matched against
        self.start_mode = start_mode
        self.detach_timeout_s = detach_timeout_s
        self.dir.mkdir(parents=True, exist_ok=True)
        self.python = python
        self.proc = proc
        self.socket = state_dir / "cubelet.sock"
        self._children: dict[str, subprocess.Popen[bytes]] = {}
        self._verified: dict[Path, tuple[_Signature, GuestImageFact | None]] = {}
        self._held_images: dict[str, int] = {}  # digest → fd of a shared lock: the image builder's prune skips it
        if launch not in LAUNCH_MODES:
            raise ValueError(f"shim launch {launch!r}: want one of {', '.join(LAUNCH_MODES)}")
        self.forks = ForkServer(self.dir, python) if launch == "fork" else None
        self.launches = {"fork": 0, "spawn": 0}  # how this process's shim starts went (a metric)
        self._prepare_lock = threading.Lock()
        self._prepare_queue: list[tuple[SnapshotPlan, DoneFn]] = []
        self._preparer: threading.Thread | None = None

    def warm(self) -> None:
        """Start the fork server now (a daemon's start), so even the first sandbox start is forked."""
        if self.forks is not None:
            self.forks.ensure_started()

    def prepare_snapshots(self, plans: Sequence[SnapshotPlan], done: DoneFn) -> None:
        """Host initialization and inventory changes: each plan's template snapshot, one `cubeaccel template
        prepare --plan` after another on one background thread (a sandbox started meanwhile boots cold and says
        so); `done` hears each outcome."""
        with self._prepare_lock:
            self._prepare_queue.extend((p, done) for p in plans)
            if self._preparer is None or not self._preparer.is_alive():
                self._preparer = threading.Thread(target=self._prepare_all, name="template-prepare", daemon=True)
                self._preparer.start()

    def _prepare_all(self) -> None:
        folder = self.dir / "template-prepare"
        folder.mkdir(exist_ok=True)
        while True:
            with self._prepare_lock:
                if not self._prepare_queue:
                    self._preparer = None
                    return
                plan, done = self._prepare_queue.pop(0)
            path = folder / f"{hashlib.sha256(plan.model_dump_json().encode()).hexdigest()[:16]}.json"
            path.write_text(plan.model_dump_json())
            argv = [self.python, "-c", "from cubeaccel.cli import main; main()", "template", "prepare"]
            argv += ["--plan", str(path), "--json"]
            with open(self.dir / "template-prepare.log", "ab") as log:
                run = subprocess.run(
                    argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log, check=False, env=component_env()
                )
            done(plan, *_prepared(run.returncode, run.stdout))

    def close(self) -> None:
        """The fork server goes (shims keep running); spawned children are not waited for; images are let go."""
        if self.forks is not None:
            self.forks.close()
        for fd in self._held_images.values():
            os.close(fd)
        self._held_images.clear()

    def bind(self, sink: ReportSink) -> None:
        """Reports come over HTTP; nothing to bind in-process."""

    def start(self, spec: ShimSpec) -> None:
        sid = spec.sandbox_id
        spec_path = self.dir / f"{sid}.json"
        try:
            launch = self._launch_spec(spec)
        except ValidationError as e:  # refused here as the shim would refuse it, before any process starts
            raise spec_error(e) from e
        self._hold_image(launch.boot_image_digest)
        spec_path.write_text(json.dumps(launch.to_json()))
        argv = [self.python, "-m", "cubeaccel.shim", "run", "--sandbox", sid, "--spec", str(spec_path)]
        token = spec.workload_token.get_secret_value() if spec.workload_token is not None else None
        with open(self.dir / f"{sid}.log", "ab") as log:
            if self.forks is not None:
                if self.forks.launch(argv, log.fileno(), token) is not None:
                    self.launches["fork"] += 1
                    return  # forked and findable in /proc by its argv, like a spawned one; its server reaps it
                if self.forks.unanswered and self._shim_pid(sid) is not None:
                    self.launches["fork"] += 1
                    return  # forked, but the answer was lost: it is there all the same
                self.forks.ensure_started()  # this start is spawned; the next ones fork
            child = subprocess.Popen(
                argv,
                env=component_env(),  # never the Cubelet's whole environment (issue 30 #6)
                stdin=subprocess.PIPE if token else subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        if token and child.stdin is not None:  # the token never touches the disk: one line on the shim's stdin
            with contextlib.suppress(OSError):
                child.stdin.write(token.encode() + b"\n")
            child.stdin.close()
        self._children[sid] = child
        self.launches["spawn"] += 1

    def _hold_image(self, digest: str | None) -> None:
        """Keep what this node boots for as long as the Cubelet runs: a rebuild's prune would otherwise remove
        the image of a template the node serves (its next create, warm refill or template state fails)."""
        if digest is None or digest in self._held_images:
            return
        m = find_image(digest)
        fd = hold_image(m.directory) if m is not None else None
        if fd is not None:
            self._held_images[digest] = fd

    def _launch_spec(self, spec: ShimSpec) -> ShimSpec:
        """The sandbox's spec plus where this shim lives and reports, checked with the shim's own limits."""
        sid = spec.sandbox_id
        return ShimSpec.model_validate(
            {
                **spec.model_dump(),
                "report": {"socket": str(self.socket)},
                "state_dir": self.dir / sid,
                # A NIC, scratch disk or mount is another machine than the template state's: always cold.
                "start": "cold" if spec.policy_devices else self.start_mode,
                "detach_timeout_s": self.detach_timeout_s,
                # A sandbox with a contract boots only the image, kernel and modules.img that contract pins.
                "image_check": "enforce" if spec.contract is not None else "report",
            },
            context=SHIM_LIMITS,
        )

    def _shim_pid(self, sandbox_id: str) -> int | None:
        child = self._children.get(sandbox_id)
        if child is not None and child.poll() is not None:
            del self._children[sandbox_id]  # reaped: not mistaken for a live process
        return find_shim(sandbox_id, self.proc, under=self.dir)

    def workload_socket(self, sandbox_id: str) -> Path:
        """Where this sandbox's shim bridges the guest's workload service (the Cubelet proxy connects here)."""
        return self.dir / sandbox_id / "workload.sock"

    def claim(self, shim_id: str, claim: ShimClaim, timeout_s: float) -> ShimClaimAck:
        """One line each way on the warm shim's `control.sock` (0600, in its run directory)."""
        path = self.dir / shim_id / CONTROL_SOCKET
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(timeout_s)
                s.connect(connect_path(path))
                s.sendall(claim.line())
                raw = bytearray()
                while not raw.endswith(b"\n") and len(raw) <= MAX_CONTROL_LINE:
                    chunk = s.recv(MAX_CONTROL_LINE)
                    if not chunk:
                        break
                    raw += chunk
            return ShimClaimAck.model_validate(json_guard.loads(bytes(raw)))
        except (OSError, ValueError, ValidationError, RecursionError) as e:
            return ShimClaimAck(ok=False, code="warm.claim_unanswered", message=f"{type(e).__name__}: {e}"[:300])

    def release_files(self, sandbox_id: str) -> list[str]:
        from cubeaccel.host.vmm.scratch import SCRATCH_FILE, remove_scratch

        return [SCRATCH_FILE] if remove_scratch(self.dir / sandbox_id) else []

    def retire_runs(self, open_ids: Callable[[], set[str]]) -> list[str]:
        return runfiles.retire_over(self.dir, open_ids, self.proc)

    def stop(self, sandbox_id: str) -> None:
        pid = self._shim_pid(sandbox_id)
        if pid is not None:
            os.kill(pid, signal.SIGTERM)

    def kill(self, sandbox_id: str) -> None:
        for pid in (self._shim_pid(sandbox_id), find_vmm(sandbox_id, self.proc, under=self.dir)):
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        self._shim_pid(sandbox_id)  # reap if already gone; never block while Cubelet holds its lock

    def pending_reports(self, sandbox_id: str) -> list[ShimReport]:
        """The shim keeps reports it could not POST in `undelivered.jsonl`; take them (rename first, so a
        report appended meanwhile lands in a fresh file and is taken next time)."""
        path = self.dir / sandbox_id / "undelivered.jsonl"
        taking = path.with_suffix(".taking")
        try:
            os.replace(path, taking)
        except FileNotFoundError:
            return []
        out = []
        for line in taking.read_text(errors="replace").splitlines():
            # a torn last line (the shim was killed mid-write) or one the wire model refuses is skipped
            with contextlib.suppress(ValueError, RecursionError):
                out.append(parse_report(json_guard.loads(line)))
        taking.unlink()
        return sorted(out, key=lambda r: r.at)

    def node_facts(self) -> NodeFacts:
        """The intact images of `cubeaccel image build`'s cache (the one the shim boots from) and QEMU's
        hot-plug paths. Each image is hashed once per change of its files, not on every heartbeat. The first is
        the default for unpinned sandboxes: the newest validation image (a userland or GPU one, newer or not,
        would not unpack in a small guest)."""
        images = cached_images(cache_dir())
        images.sort(key=lambda m: label_of(m) != "")  # stable: the newest validation image first, the default
        facts = [f for m in images[:MAX_IMAGES] if (f := self._intact(m)) is not None]
        return NodeFacts(tuple(facts), hotplug_paths())

    def _intact(self, m: Manifest) -> GuestImageFact | None:
        files = [m.directory / "manifest.json", *(m.path(a) for a in (m.vmlinux, m.modules_img, m.rootfs, m.initrd))]
        try:
            sig = tuple((st.st_mtime_ns, st.st_size) for st in (f.stat() for f in files))
        except OSError:
            return None
        memo = self._verified.get(m.directory)
        if memo is None or memo[0] != sig:
            memo = self._verified[m.directory] = (sig, None if m.verify() else m.fact())
        return memo[1]

    def status(self, sandbox_id: str) -> ShimStatus:
        if not self.proc.is_dir():
            return ShimStatus(None, None)
        vmm = find_vmm(sandbox_id, self.proc, under=self.dir)
        return ShimStatus(shim_alive=self._shim_pid(sandbox_id) is not None, vmm_alive=vmm is not None, vmm_pid=vmm)


def _prepared(returncode: int, stdout: bytes) -> tuple[dict[str, object] | None, CubeError | None]:
    """`cubeaccel template prepare --json`'s answer: the state's key, whether it was made now and how long it took;
    or its error's message (`{"ok": false, "error": {...}}`), or how it exited when it printed none."""
    try:
        out = json_guard.loads(stdout)
    except (ValueError, RecursionError):
        out = None
    if returncode == 0 and isinstance(out, dict):
        return {k: out[k] for k in ("key", "created", "build_s") if k in out}, None
    err = out.get("error") if isinstance(out, dict) else None
    message = err.get("message") if isinstance(err, dict) else None
    why = str(message or f"`cubeaccel template prepare` exited {returncode} without an answer")[:500]
    return None, CubeError("template.prepare_failed", why, "template")
