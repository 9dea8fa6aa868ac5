"""Scrub between tenants: a trusted VM clears what the last tenant could leave in the device (docs/scrub.md).

A reset (FLR, bus reset) returns registers to their defaults but does not promise to clear device memory. So, per
device class, the release path may run one more step after the reset and before revalidation: boot a *scrub VM*
(our own guest image, no tenant code, no workload channel) with the device attached, whose agent zeroes every
allocatable byte (CUDA) or every tenant-writable register (the emulated edu) and verifies, then reset again. The
device becomes allocatable only after that passed; a failure or a timeout quarantines it (`release.scrub_failed`).

The runner is the only part that knows how a VM is started; the decision (scrub owed? passed?) is Cubelet's.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from cubeaccel.backends.base import AttachSpec, Problem
from cubeaccel.backends.scrub_methods import NO_METHOD, ScrubMethod, kind_key, method_for, no_method_message
from cubeaccel.cubelet import runfiles
from cubeaccel.host.service.childenv import component_env
from cubeaccel.host.vmm.vmmproc import find_shim, find_vmm, vmm_processes
from cubeaccel.images.scrub_image import ScrubImage, ScrubImages
from cubeaccel.model.device import AcceleratorClass, DeviceRecord
from cubeaccel.protocol.errors import invalid
from cubeaccel.wire.scrub import ScrubReport
from cubeaccel.wire.shim_spec import SHIM_LIMITS, ShimSpec


class ScrubPolicy(StrEnum):
    NONE = "none"  # reset only: for classes with no tenant-writable memory, or an operator's informed choice
    TRUSTED_VM = "trusted-vm"


# Every class we manage has device memory a tenant writes (GPU VRAM/HBM; TPU/XPU-like accelerators too): scrub.
DEFAULT_POLICY: dict[str, ScrubPolicy] = {c.value: ScrubPolicy.TRUSTED_VM for c in AcceleratorClass}
STOP_GRACE_S = 10.0
GONE_TIMEOUT_S = 10.0  # a SIGKILLed VMM's exit (its memory unlocked) is awaited this long
SCRUB_PREFIX = "scrub-"
REPORTS = "scrub-reports.jsonl"  # in the scrub VM's run dir


KIND_RE = re.compile(r"[0-9a-f]{4}:[0-9a-f]{4}")


def parse_policy(items: list[str] | tuple[str, ...]) -> dict[str, ScrubPolicy]:
    """`CLASS=POLICY` or `VVVV:DDDD=POLICY` (one device kind, over its class's) pairs over the default
    (`gpu=none`, `1002:74a1=none`); an unknown class or policy is refused, not ignored."""
    policy = dict(DEFAULT_POLICY)
    for item in items:
        key, _, value = item.partition("=")
        key = key.lower()
        if (key not in DEFAULT_POLICY and not KIND_RE.fullmatch(key)) or value not in {p.value for p in ScrubPolicy}:
            raise invalid(
                "cubelet.invalid_scrub_policy",
                f"--scrub wants CLASS=POLICY or VVVV:DDDD=POLICY with CLASS in {sorted(DEFAULT_POLICY)} and POLICY "
                f"in {[p.value for p in ScrubPolicy]}, not {item!r}",
            )
        policy[key] = ScrubPolicy(value)
    return policy


def policy_for(policies: dict[str, ScrubPolicy], device: DeviceRecord) -> ScrubPolicy:
    """The device kind's policy if the operator named one, else its class's (default trusted-vm)."""
    kind = policies.get(kind_key(device.identity))
    return kind if kind is not None else policies.get(device.accel_class.value, ScrubPolicy.TRUSTED_VM)


def refusal(policies: dict[str, ScrubPolicy], device: DeviceRecord) -> Problem | None:
    """A device with no registered scrub method under trusted-vm: held at host initialization, never written to."""
    if policy_for(policies, device) is not ScrubPolicy.TRUSTED_VM or method_for(device.identity) is not None:
        return None
    return Problem(NO_METHOD, no_method_message(device.identity, device.accel_class.value), hard=False, held=True)


def scrub_method(device: DeviceRecord) -> ScrubMethod:
    """The registry's method for the device (backends/scrub_methods.py); one never reaches a scrub without one
    (refused at host initialization), so a missing one here is a bug that fails the scrub, never a guess."""
    method = method_for(device.identity)
    if method is None:
        raise ValueError(f"no scrub method registered for {kind_key(device.identity)}")
    return method


def scrub_method_name(device: DeviceRecord) -> str | None:
    method = method_for(device.identity)
    return method.name if method is not None else None


def scrub_needs_vm(device: DeviceRecord) -> bool:
    """False only for a kind whose registered method is `vmm-exit` (nothing of the tenant's outlives its VMM);
    a kind with no method (the operator set its policy) is treated as needing one, never as clean."""
    method = method_for(device.identity)
    return method is None or method.needs_vm


SCRUB_FAILED = "release.scrub_failed"  # the scrub ran and did not verify (or did not finish): the operator looks
VM_NOT_STARTED = "release.scrub_vm_not_started"  # the scrub VM never got to scrub: reconcile retries it
IMAGE_UNAVAILABLE = "release.scrub_image_unavailable"  # no usable image to boot: retried once the image is here


@dataclass(frozen=True)
class ScrubOutcome:
    ok: bool
    message: str = ""
    details: dict[str, Any] = field(default_factory=dict)  # bytes, timings, the agent's result, the VM's timeline
    reason: str = SCRUB_FAILED  # the quarantine reason when not ok (model/recovery.py classes it)


class ScrubRunner(Protocol):
    @property
    def inline(self) -> bool:
        """True: runs in the caller's thread (simulated); False: Cubelet gives it a thread."""
        ...

    def run(self, device: DeviceRecord, attach: AttachSpec, timeout_s: float) -> ScrubOutcome:
        """Boot the scrub VM with the device, scrub, verify, tear down; blocks; never raises for a device fault."""
        ...


@runtime_checkable
class ScrubImageCheck(Protocol):
    """A runner that boots an image can say, before any tenant, whether it has one for a method (host readiness,
    cubelet/scrub_ready.py). A runner without this check (simulated, none) has no image to miss."""

    def image_problem(self, method: ScrubMethod) -> Problem | None: ...


class SimulatedScrubRunner:
    """The simulated node's scrub VM, as its shim driver plays its sandboxes' VMs: passes, at once."""

    inline = True

    def run(self, device: DeviceRecord, attach: AttachSpec, timeout_s: float) -> ScrubOutcome:
        mib = int(device.labels.get("memory_mib", "0") or 0) or 1024 * int(device.labels.get("memory_gib", "0") or 0)
        chunks = -(-mib // 256)  # the agent's 256 MiB chunks, each sampled at its first, last and 4 random pages
        played = ScrubReport(
            ok=True,
            method=scrub_method(device).name,
            pattern="0x00",
            bytes_zeroed=mib * 1024 * 1024,
            bytes_verified=chunks * 6 * 4096,
            pages_sampled=chunks * 6,
        )
        return ScrubOutcome(True, "simulated", {**played.evidence(), "image_digest": "simulated"})


class UnavailableScrubRunner:
    """No way to boot a scrub VM was configured: a scrub owed fails, so the device is quarantined, never reused."""

    inline = True

    def run(self, device: DeviceRecord, attach: AttachSpec, timeout_s: float) -> ScrubOutcome:
        return ScrubOutcome(False, "this Cubelet has no scrub runner (policy trusted-vm needs one)")


class ProcessScrubRunner:
    """A `cubeaccel shim run` in scrub mode: the same shim that boots sandboxes, told to run the agent's scrub op
    on its one device and exit. It lives under the Cubelet's `shims/` directory, so while it runs its VMM is the
    device's holder like any tenant's (nothing else can take the device), and reports go to a file Cubelet reads."""

    inline = False

    def __init__(
        self,
        state_dir: Path,
        start_mode: str = "template",
        image_digest: str | None = None,
        python: str = sys.executable,
        proc: Path = Path("/proc"),
        detach_timeout_s: float = 10.0,
    ) -> None:
        self.dir = (state_dir / "shims").absolute()
        self.start_mode = start_mode
        self.image_digest = image_digest  # None: the node's default image (the newest our builder made)
        from cubeaccel.images.builder import agent_digest, cache_dir, cached_images

        self.images = ScrubImages(
            image_digest,
            images=lambda: cached_images(cache_dir()),  # the cache as it is now: $CUBEACCEL_CACHE_DIR at each look
            agent=agent_digest,
            memo=state_dir / "scrub-images.json" if state_dir.is_dir() else None,
        )
        self.python = python
        self.proc = proc
        self.detach_timeout_s = detach_timeout_s

    def image(self, method: ScrubMethod) -> ScrubImage:
        """The operator's `--scrub-image` (unless the cache shows it is of another stack), else the newest built
        image of the method's stack (`nvidia` for `cuda`: its driver and libcuda; "" CPU-only) that carries
        *this* Cubelet's agent: the scrub op is the one this code ships, never whatever agent the newest image in
        a shared cache happens to have (an older one answers `agent.unknown_method`). Its files verified against
        the digests its manifest pins (images/scrub_image.py)."""
        return self.images.choose(method.image_stack)

    def image_problem(self, method: ScrubMethod) -> Problem | None:
        """Host readiness for the devices this method scrubs: None when their scrub VM's image is here and intact;
        else held (`host.scrub_image_missing` / `host.scrub_image_mismatch`), never a failed scrub."""
        if not method.needs_vm:
            return None
        chosen = self.image(method)
        if chosen.code is None:
            return None
        return Problem(chosen.code, chosen.message, hard=False, held=True)

    def spec(self, sid: str, device: DeviceRecord, attach: AttachSpec) -> ShimSpec:
        run_dir = self.dir / sid
        method = scrub_method(device)
        return ShimSpec.model_validate(
            {
                "sandbox_id": sid,
                "devices": [
                    {
                        "device_id": device.id,
                        "address": str(device.address),
                        "driver": attach.driver,
                        "properties": attach.properties,
                        "memory_file": None
                        if attach.memory_file is None
                        else {"path": attach.memory_file[0], "size": attach.memory_file[1]},
                        "vendor_id": device.identity.vendor_id,
                        "device_id_hex": device.identity.device_id,
                        "bars": [b.to_json() for b in device.identity.bars],
                    }
                ],
                "memory_mib": method.memory_mib,
                "vcpus": 1,
                "pin_memory": True,
                "image_digest": self.image(method).digest,
                "start": method.start or self.start_mode,
                "state_dir": str(run_dir),
                "report": {"file": str(run_dir / REPORTS)},
                "detach_timeout_s": self.detach_timeout_s,
                "scrub": method.name,
                "scrub_params": method.params,
            },
            context=SHIM_LIMITS,
        )

    def run(self, device: DeviceRecord, attach: AttachSpec, timeout_s: float) -> ScrubOutcome:
        sid = f"scrub-{uuid.uuid4().hex[:12]}"
        t0 = time.monotonic()
        try:
            spec = self.spec(sid, device, attach)
        except ValueError as e:
            return ScrubOutcome(False, f"cannot build the scrub VM's spec: {e}"[:500], {"scrub_vm": sid})
        chosen = self.image(scrub_method(device))
        if not chosen.usable:
            # nothing was booted: the device is as the reset left it, and it is retried once the image is here
            details = {"scrub_vm": sid, "image_problem": chosen.code, "image_digest": chosen.digest}
            return ScrubOutcome(False, chosen.message, details, IMAGE_UNAVAILABLE)
        # A scrub VM of this device left by a Cubelet that died mid-scrub: ended before another one boots.
        ended = self.end_scrub_vms(device.id)
        run_dir = self.dir / sid
        run_dir.mkdir(parents=True, exist_ok=True)
        spec_path = self.dir / f"{sid}.json"
        spec_path.write_text(json.dumps(spec.to_json()))
        try:
            return self._run(sid, run_dir, spec_path, timeout_s, t0, ended, spec.image_digest)
        finally:  # every exit path: a shim that died after its QEMU started leaves that QEMU to us
            self._end(sid)
            with contextlib.suppress(OSError):  # over: its files are kept by the finished-runs rule
                runfiles.retire(self.dir, sid)

    def _run(
        self,
        sid: str,
        run_dir: Path,
        spec_path: Path,
        timeout_s: float,
        t0: float,
        ended: list[str],
        image_digest: str | None,
    ) -> ScrubOutcome:
        with open(self.dir / f"{sid}.log", "ab") as log:
            child = subprocess.Popen(
                [self.python, "-m", "cubeaccel.shim", "run", "--sandbox", sid, "--spec", str(spec_path)],
                env=component_env(),  # never the Cubelet's whole environment (issue 30 #6)
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        timed_out = False
        try:
            rc = child.wait(timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            rc = self._stop(sid, child)
        reports = _reports(run_dir / REPORTS)
        done = next((r for r in reports if r.get("kind") == "scrub_finished"), None)
        exited = next((r for r in reports if r.get("kind") == "shim_exiting"), None)
        details: dict[str, Any] = {
            "scrub_vm": sid,
            "vm_s": round(time.monotonic() - t0, 3),
            "shim_rc": rc,
            "timeout_s": timeout_s,
        }
        if ended:
            details["orphans_ended"] = ended
        if killed := self._end(sid):
            details["vmm_killed"] = killed  # its shim died and left it running
        if exited is not None:
            details["timeline"] = exited.get("details", {}).get("timeline")
        result = (done or {}).get("details", {}).get("result") if done else None
        details["image_digest"] = (done or {}).get("details", {}).get("image_digest") or image_digest
        if isinstance(result, dict):
            try:  # the evidence, typed as the shim checked it (docs/scrub.md)
                details.update(ScrubReport.model_validate(result).evidence())
            except ValueError as e:
                return ScrubOutcome(False, f"malformed scrub result: {e}"[:500], details)
            details["agent"] = result
        if timed_out:
            return ScrubOutcome(False, f"the scrub VM did not finish within {timeout_s:g}s", details)
        if not isinstance(result, dict):
            failed = next((r for r in reports if r.get("kind") == "attach_failed"), None)
            why = (failed or {}).get("details", {}).get("reason", "no scrub result reported")
            return ScrubOutcome(False, f"the scrub VM failed before scrubbing: {why}", details, VM_NOT_STARTED)
        if not result.get("ok") or rc != 0:
            return ScrubOutcome(False, str(result.get("error") or f"scrub VM exited {rc}")[:500], details)
        return ScrubOutcome(True, "", details)

    def _end(self, sid: str) -> list[int]:
        """SIGKILL what still runs of scrub VM `sid` (its shim, its VMM: found in /proc by argv and tag, under
        this Cubelet's shims directory only) and wait until the kernel shows it gone; returns the pids killed."""
        pids = [p for p in (find_shim(sid, self.proc, under=self.dir), find_vmm(sid, self.proc, under=self.dir)) if p]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + GONE_TIMEOUT_S
        while pids and time.monotonic() < deadline:
            if find_shim(sid, self.proc, under=self.dir) is None and find_vmm(sid, self.proc, under=self.dir) is None:
                break
            time.sleep(0.02)
        return pids

    def end_scrub_vms(self, device_id: str) -> list[str]:
        """End every scrub VM of `device_id` still running from an earlier Cubelet process (its scrub job lived
        in that process's memory only): named by its spec (written before its shim starts) or by its VMM's
        device tag. Returns their ids."""
        sids: set[str] = set()
        for spec_path in self.dir.glob(f"{SCRUB_PREFIX}*.json") if self.dir.is_dir() else []:
            with contextlib.suppress(OSError, ValueError, AttributeError, TypeError):
                devices = json.loads(spec_path.read_text()).get("devices") or []
                if any(isinstance(d, dict) and d.get("device_id") == device_id for d in devices):
                    sids.add(spec_path.stem)
        for p in vmm_processes(self.proc):
            if p.sandbox_id.startswith(SCRUB_PREFIX) and device_id in p.device_ids and p.under(self.dir):
                sids.add(p.sandbox_id)
        ended = []
        for sid in sorted(sids):
            if self._end(sid):
                ended.append(sid)
            with contextlib.suppress(OSError):
                runfiles.retire(self.dir, sid)
        return ended

    def _stop(self, sid: str, child: subprocess.Popen[bytes]) -> int:
        """Past the deadline: SIGTERM lets the shim tear its VMM down; then SIGKILL both (never another's VMM:
        the VMM is found by its tag *and* under this Cubelet's shims directory)."""
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signal.SIGTERM)
        try:
            return child.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
        for pid in (child.pid, find_vmm(sid, self.proc, under=self.dir)):
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        return child.wait()


def _reports(path: Path) -> list[dict[str, Any]]:
    out = []
    with contextlib.suppress(OSError):
        for line in path.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                item = json.loads(line)
                if isinstance(item, dict):
                    out.append(item)
    return out
