"""The shim process: one sandbox's MicroVM from start to a confirmed VMM exit, every step reported.

Order is the safety argument: memory is proven locked before any hot-plug; a device is hot-plugged only after the
guest's agent answered; it is reported attached only when the guest sees its vendor:device; on teardown it is
reported detached only on the VMM's removal event, and the VMM's exit is reported only after waitpid. A failed
step tears down (no device is ever left in a running VM the shim gave up on); Cubelet decides about the device.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from types import FrameType

from cubeaccel.host.net import netpolicy
from cubeaccel.host.service.private import private_umask
from cubeaccel.host.vmm import scratch
from cubeaccel.host.vmm.hypervisor import host_cpus, numa_nodes
from cubeaccel.images.builder import cache_dir, cached_images, find_image
from cubeaccel.images.manifest import Manifest
from cubeaccel.model.bars import (
    human_bytes,
    parse_resource_lines,
    unassigned_bars,
)
from cubeaccel.model.cold_start import COLD_NO_SNAPSHOT, cold_start_reason
from cubeaccel.model.start_deadlines import start_deadlines
from cubeaccel.protocol.agent_messages import PciFunction, ProbeParams, ShutdownParams, WaitPciParams
from cubeaccel.protocol.agent_protocol import CUDA_TIMEOUT_S, MODPROBE_TIMEOUT_S
from cubeaccel.protocol.errors import CubeError
from cubeaccel.shim.agent_client import AgentClient
from cubeaccel.shim.console import CONSOLE_LOG, ConsoleCap
from cubeaccel.shim.image_check import image_mismatches
from cubeaccel.shim.load_scale import host_deadline_scale
from cubeaccel.shim.machine import vm_config
from cubeaccel.shim.memory import prove_pinned
from cubeaccel.shim.qemu import QemuVmm
from cubeaccel.shim.reporter import Reporter
from cubeaccel.shim.template import snapshot_lookup, template_lease
from cubeaccel.shim.vmm import ExitInfo, VmConfig
from cubeaccel.shim.warm_control import WarmControl, unknowable_token, warm_up
from cubeaccel.shim.workload_bridge import WorkloadBridge, workload_error
from cubeaccel.transport.telemetry import configure_logging, set_request_id
from cubeaccel.wire.reports import (
    AttachFailed,
    DetachTimeout,
    DeviceAttached,
    DeviceDetached,
    GuestReady,
    GuestValidated,
    GuestValidationFailed,
    MemoryPinned,
    PlacedBar,
    ScrubFinished,
    ShimExiting,
    VmmConfined,
    VmmExited,
    VmStarted,
    WarmClaimed,
    WorkloadReady,
    WorkloadRecovered,
    WorkloadUnresponsive,
)
from cubeaccel.wire.scrub import ScrubReport
from cubeaccel.wire.shim_spec import DeviceSpec, ShimSpec
from cubeaccel.wire.snapshot import SnapshotLookup
from cubeaccel.wire.warm import ShimClaim

PIN_PROOF_TIMEOUT_S = 5.0
VISIBLE_TIMEOUT_S = 10.0
BAR_SETTLE_S = 3.0  # from the function's appearance to every BAR placed (ms in practice; only a failure waits)
AGENT_SHUTDOWN_TIMEOUT_S = 2.0
STOP_GRACE_S = 5.0
RESEED_TIMEOUT_S = 5.0  # one write and two ioctls in the guest
SCRUB_TIMEOUT_S = 3600.0  # the agent's own bound; Cubelet's scrub timeout (which kills this VM) comes first


def exit_details(info: ExitInfo) -> VmmExited:
    return VmmExited(pid=info.pid, status=info.status, exit_code=info.exit_code, signal=info.signal, how=info.how)


def qdev_id(index: int) -> str:
    return f"accel{index}"


def probe_timeout_s(contract: dict[str, object] | None, scale: float = 1.0) -> float:
    """Long enough for the agent's own timeouts to fire first, so a slow step is reported at its real layer
    (modules_img, cuda_runtime) rather than as an `agent.timeout` of the whole probe. `scale`: the load stretch
    sent with the probe (`host_deadline_scale`), which stretches the agent's timeouts alike."""
    probes = (contract or {}).get("guest_probes") or (contract or {}).get("probes") or {}
    modules = probes.get("modules", []) if isinstance(probes, dict) else []
    cuda = isinstance(probes, dict) and bool(probes.get("cuda") or probes.get("libraries"))
    n = len(modules) if isinstance(modules, list) else 0
    return max(60.0, 10.0 + MODPROBE_TIMEOUT_S * n + (2 * CUDA_TIMEOUT_S if cuda else 0.0)) * scale


class Shim:
    def __init__(self, spec: ShimSpec, workload_token: str | None = None) -> None:
        self.spec = spec
        self.workload_token = workload_token
        self.bridge: WorkloadBridge | None = None
        self.control: WarmControl | None = None  # a warm shim's claim socket
        self.reporter = Reporter(
            spec.sandbox_id, spec.report_socket, spec.report_file, spec.run_dir, start_id=spec.start_id
        )
        self.vmm: QemuVmm | None = None
        self.agent: AgentClient | None = None
        self.added: dict[str, DeviceSpec] = {}  # qdev id → device, once device_add was accepted
        self.guest_addresses: dict[str, str] = {}  # device id → where the guest saw it appear
        self._known: set[str] | None = None  # guest PCI addresses before our hot-plugs, when the agent waits
        self._agent_methods: frozenset[str] = frozenset()
        self._reseeded: dict[str, object] | None = None  # the guest's answer to a claim's reseed
        self._agent_lock = threading.Lock()  # a claim's reseed (control thread) and the teardown share the channel
        self.timeline: dict[str, float] = {}
        self.deadlines = start_deadlines(spec.memory_mib, spec.boot_timeout_s)
        self._stop = False
        self.image_digest: str | None = None  # the guest image booted (a scrub's evidence names it)
        self.vendor_modules: tuple[str, ...] = ()  # the booted image's driver stack (its manifest's `vendor`)
        self.console = ConsoleCap(spec.run_dir / CONSOLE_LOG)  # the guest's one unbounded output, capped
        self._policy_fds: list[int] = []  # TAP and scratch disk: ours until the VMM inherited them
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)

    # -- signals ---------------------------------------------------------------------------------------------
    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._stop = True
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    def _check_stop(self) -> None:
        if self._stop:
            raise CubeError("shim.stop_requested", "teardown requested during startup", layer="cubelet")

    def _phase(self, name: str, t0: float) -> float:
        self.timeline[name] = round(time.monotonic() - t0, 4)
        return time.monotonic()

    # -- run -------------------------------------------------------------------------------------------------
    def run(self) -> int:
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            return self._run()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            os.close(self._wake_r)
            os.close(self._wake_w)

    def _run(self) -> int:
        self.spec.run_dir.mkdir(parents=True, exist_ok=True)
        (self.spec.run_dir / "shim.pid").write_text(f"{os.getpid()}\n")
        rc = 0
        reason = "stopped"
        try:
            self._start()
            if self.spec.scrub is not None:  # a scrub VM does its one job and goes; nothing waits on it
                rc, reason = self._scrub()
            else:
                self._wait()
                if self.vmm is not None and self.vmm.poll_exit() is not None and not self._stop:
                    rc, reason = 1, "vmm_exited_unexpectedly"  # guest poweroff, crash, or killed from outside
                else:
                    reason = "stop_requested"
        except CubeError as e:
            stopped = e.code in ("shim.stop_requested", "agent.cancelled")
            rc, reason = (0, "stop_requested") if stopped else (1, e.code)
            if rc:
                self.reporter.report(
                    AttachFailed(reason=e.code, layer=e.layer, message=e.message, **e.details),
                    tuple(d.device_id for d in self.spec.devices),
                )
        except Exception as e:  # a bug or a hostile guest's reply: still report, still tear down
            rc, reason = 1, "shim.internal_error"
            self.reporter.report(
                AttachFailed(reason=reason, layer="cubelet", message=f"{type(e).__name__}: {e}"[:500]),
                tuple(d.device_id for d in self.spec.devices),
            )
        finally:
            exit_info = self._teardown()
            self.console.stop()
            self.reporter.report(
                ShimExiting(
                    reason=reason,
                    exit_code=rc,
                    timeline=self.timeline,
                    vmm_exit=exit_details(exit_info) if exit_info else None,
                )
            )
        return rc

    def _policy_devices(self, cfg: VmConfig) -> VmConfig:
        """The sandbox policy's host ends, made before the VMM: the scratch disk and an fd on the TAP."""
        spec = self.spec
        if spec.scratch_mib is not None:
            scratch.create_scratch(spec.run_dir / scratch.SCRATCH_FILE, spec.scratch_mib)
            for mode in (os.O_RDWR, os.O_RDONLY):
                self._policy_fds.append(os.open(spec.run_dir / scratch.SCRATCH_FILE, mode | os.O_CLOEXEC))
            cfg = replace(cfg, scratch_fd=self._policy_fds[-2], scratch_ro_fd=self._policy_fds[-1])
        if spec.network is not None:
            self._policy_fds.append(netpolicy.open_tap(spec.network.netns, spec.network.tap))
            net = f"{spec.network.guest_cidr},{spec.network.gateway}"
            cfg = replace(cfg, tap_fd=self._policy_fds[-1], mac=spec.network.mac, guest_net=net)
        if spec.readonly_mounts:
            cfg = replace(cfg, ro_mounts=tuple((str(m.source), m.target) for m in spec.readonly_mounts))
        return cfg

    def _vm_config(self, manifest: Manifest) -> VmConfig:
        return vm_config(self.spec, manifest, host_cpus(), numa_nodes())

    def _start(self) -> None:
        """The start in its safety order: the image checked against the contract; the VMM started and reported;
        its confinement and locked memory proven before anything reaches the guest; the guest's agent met; each
        device hot-plugged and seen by the guest; the workload up; the guest validated."""
        manifest, mismatches = self._checked_image()
        cfg = self._policy_devices(self._vm_config(manifest))
        vmm, restore, cold_reason, lookup, t = self._launch(cfg, manifest)
        warm_token = self._open_bridge()
        t = self._phase("vmm_start_s", t)
        self.reporter.report(
            VmStarted(
                pid=vmm.pid,
                vmm=vmm.kind,
                accel=vmm.accel,
                accel_reason=vmm.accel_reason,
                start="cold" if restore is None else "template",
                cold_reason=cold_reason,
                snapshot=lookup,
                image_digest=manifest.image_digest,
                kernel_release=manifest.kernel_release,
                image_mismatches=mismatches,
                uid=vmm.lease.uid if vmm.lease else None,
            )
        )
        t = self._prove_vmm(vmm, t)
        self._check_stop()
        agent, t = self._meet_agent("boot_to_agent_s" if restore is None else "restore_to_agent_s", t)
        for i, dev in enumerate(self.spec.devices):
            self._check_stop()
            self._attach(vmm, agent, i, dev)
        t = self._phase("hotplug_to_visible_s", t)
        t = self._workload_up(warm_token, t)
        # Every sandbox is validated in the guest, a CPU-only one too (its kernel, modules, libraries); without a
        # contract, the minimal checks.
        self._validate(agent)
        self._phase("guest_validation_s", t)

    def _checked_image(self) -> tuple[Manifest, list[dict[str, str]]]:
        """The guest image to boot and how it differs from the contract (refused when the spec enforces it)."""
        spec = self.spec
        if not spec.hotplug and spec.devices:  # a CPU-only sandbox (no device) plugs nothing
            raise CubeError(
                "shim.coldplug_unsupported",
                "the contract expects devices attached at VM start (hotplug: false); this shim only hot-plugs",
                layer="backend",
                status=500,
            )
        manifest = self._manifest()
        self.image_digest = manifest.image_digest
        self.vendor_modules = manifest.vendor.modules if manifest.vendor is not None else ()
        self.deadlines = start_deadlines(spec.memory_mib, spec.boot_timeout_s, manifest.initrd_bytes())
        mismatches = image_mismatches(spec.contract, manifest)
        if mismatches and spec.image_check == "enforce":
            first = mismatches[0]
            raise CubeError(
                first["code"],
                f"guest image does not match the contract: {first['expected']} pinned, {first['found']} built",
                layer=first["layer"],
                details={"mismatches": mismatches},
            )
        return manifest, mismatches

    def _launch(
        self, cfg: VmConfig, manifest: Manifest
    ) -> tuple[QemuVmm, Path | None, str | None, SnapshotLookup | None, float]:
        """The VMM, restored from the machine's template state when there is one and the start may use it:
        (the VMM, the state restored or None, why it booted cold, what the lookup found, the time it was up)."""
        t = time.monotonic()
        restore = None
        lookup = None
        cold_reason: str | None = cold_start_reason(self.spec.start, self.spec.policy_devices)
        with contextlib.ExitStack() as lease:  # the template state cannot be pruned until the restore read it
            if cold_reason is None:  # only looked up: a snapshot is never made on a tenant's start
                root = cache_dir() / "templates"
                restore = lease.enter_context(template_lease(cfg, manifest, root))
                cold_reason = None if restore is not None else COLD_NO_SNAPSHOT
                lookup = snapshot_lookup(cfg, manifest, root, restore)
                t = self._phase("template_lookup_s", t)
            vmm = QemuVmm(cfg, restore_from=restore, deadlines=self.deadlines)
            try:
                vmm.start()
            except OSError as e:
                raise CubeError("vmm.start_failed", f"cannot start the VMM: {e}", layer="backend", status=500) from e
            finally:
                if vmm.started:
                    self.vmm = vmm  # only a VMM that exists is torn down
                    self.console.start()
                while self._policy_fds:  # the VMM holds its own copies now
                    os.close(self._policy_fds.pop())
        self.timeline.update({k: round(v, 4) for k, v in vmm.timings.items()})
        return vmm, restore, cold_reason, lookup, t

    def _open_bridge(self) -> str | None:
        """The workload bridge, connected now: the preamble waits in the port until the guest service reads it.
        Returns a warm sandbox's own token (the warm-up's, never kept past this start)."""
        spec = self.spec
        if not spec.workload:
            return None
        warm_token: str | None = None
        if spec.warm and not self.workload_token:  # refuses everything until a claim brings the tenant's
            self.workload_token = warm_token = unknowable_token()
        if not self.workload_token:
            raise workload_error("workload.no_token", "the spec asks for the workload bridge but no token came")
        self.bridge = WorkloadBridge(
            spec.run_dir / "workload-vmm.sock",
            spec.run_dir / "workload.sock",
            self.workload_token,
            on_health=self._workload_health,
        )
        self.workload_token = None  # the bridge holds it (a warm one must not outlive its claim anywhere)
        self.bridge.start(10.0)
        return warm_token

    def _workload_health(self, answering: bool, why: str) -> None:
        """The bridge found the workload service gone (or back): the Cubelet's event trail says so, by name."""
        if answering:
            self.reporter.report(WorkloadRecovered(message=why))
        else:
            self.reporter.report(WorkloadUnresponsive(reason="workload.unresponsive", message=why))

    def _prove_vmm(self, vmm: QemuVmm, t: float) -> float:
        """Before anything reaches the guest: the VMM runs as launched (uid, no capabilities, seccomp, own
        mounts), and its guest memory is locked where the spec asks."""
        self.reporter.report(VmmConfined(**vmm.verify_confined()))
        t = self._phase("confinement_proof_s", t)
        if self.spec.pin_memory:
            proof = self._prove_pinned(vmm)
            t = self._phase("pin_proof_s", t)
            self.reporter.report(MemoryPinned(**proof))
        return t

    def _meet_agent(self, phase: str, t: float) -> tuple[AgentClient, float]:
        """The guest's agent said hello: what it can do, and the PCI addresses it already had."""
        self.agent = agent = AgentClient(self.spec.run_dir / "agent.sock")
        agent.connect(10.0)
        hello = agent.wait_hello(self.deadlines.guest_ready_s, cancelled=lambda: self._stop)
        self._agent_methods = frozenset(hello.methods or ())
        self._check_stop()
        t = self._phase(phase, t)
        self.reporter.report(GuestReady(agent=hello.to_json()))
        addresses = hello.pci_addresses
        if "wait_pci" in self._agent_methods and addresses is not None and len(addresses) <= 1024:
            self._known = set(addresses)  # an older agent: probes before and after instead
        return agent, t

    def _workload_up(self, warm_token: str | None, t: float) -> float:
        """Before validation: a sandbox reported validated is one that can run work (and, warm, be claimed)."""
        if self.bridge is None:
            return t
        took = self.bridge.wait_healthy(self.spec.boot_timeout_s, cancelled=lambda: self._stop)
        t = self._phase("workload_up_s", t)
        self.reporter.report(WorkloadReady(health_ms=round(took * 1000, 1), socket="workload.sock"))
        if self.spec.warm:
            if warm_token is not None:
                warm_up(self.bridge, warm_token)  # a failure costs the first command its cold start, never the sandbox
                t = self._phase("warm_up_s", t)
            # Listening before the validated report, after which the Cubelet may claim at once; a claim cannot
            # come earlier (the sandbox is warm only once validated).
            self.control = WarmControl(self.spec.run_dir, self.bridge, self._claimed, self._reseed)
            self.control.start()
        return t

    def _reseed(self, seed: str) -> bool:
        """The claim's seed into the guest kernel's RNG (cube-agent's `reseed`); True only when the guest says
        its CRNG was reseeded from it: a seed only mixed into the input pool leaves every clone of one snapshot
        drawing the same numbers until the kernel's own reseed. Called on the control socket's thread: the
        agent channel is held meanwhile."""
        if "reseed" not in self._agent_methods:
            return False
        with self._agent_lock:
            if self.agent is None or self._stop:
                return False
            result = self.agent.reseed(seed, timeout_s=RESEED_TIMEOUT_S, cancel_fd=self._wake_r)
        self._reseeded = result.facts()  # what the guest says it did, for the report
        return result.reseeded

    def _claimed(self, claim: ShimClaim) -> None:
        self.reporter.report(WarmClaimed(claimed_as=claim.sandbox_id, reseed=self._reseeded))

    def _manifest(self) -> Manifest:
        """The image named in the spec: an explicit manifest, else the cached image with `image_digest` (or, when
        the spec names none, the digest its contract pins).

        Never "the last one built": a sandbox boots the guest its contract pins (or the default Cubelet chose
        and recorded), so a rebuild between placement and start cannot change what a sandbox runs.
        """
        if self.spec.image_manifest is not None:
            return Manifest.load(self.spec.image_manifest)
        digest = self.spec.boot_image_digest
        if digest is None:
            raise CubeError(
                "shim.no_image",
                "no guest image named, and the node has none: run `cubeaccel image build`",
                layer="template",
                status=500,
            )
        found = find_image(digest)  # artifacts were hashed by Cubelet before it advertised the image
        if found is None or not all(found.path(a).is_file() for a in (found.vmlinux, found.initrd)):
            have = [m.image_digest for m in cached_images()]
            raise CubeError(
                "shim.image_not_found",
                f"guest image {digest} is not in the image cache {cache_dir() / 'images'} ({len(have)} other images)",
                layer="template",
                details={"expected": digest, "found": have},
                status=500,
            )
        return found

    def _prove_pinned(self, vmm: QemuVmm) -> dict[str, int]:
        deadline = time.monotonic() + PIN_PROOF_TIMEOUT_S
        while True:
            try:
                return prove_pinned(vmm.pid, self.spec.memory_mib)
            except CubeError:
                if time.monotonic() > deadline or vmm.poll_exit() is not None:
                    raise
            time.sleep(0.02)

    def _attach(self, vmm: QemuVmm, agent: AgentClient, index: int, dev: DeviceSpec) -> None:
        qid = qdev_id(index)
        t0 = time.monotonic()
        waits = self._known is not None  # the agent waits in the guest: no probe before, no polling after
        before = set(self._known) if self._known is not None else {d.address for d in agent.pci_devices()}
        try:
            properties = dict(dev.properties)
            if dev.memory_file is not None:
                vmm.add_memory(f"mem-{qid}", str(dev.memory_file.path), dev.memory_file.size)
                properties["memdev"] = f"mem-{qid}"
            att = vmm.add_device(qid, dev.driver, properties, index)
        except CubeError as e:
            raise CubeError(
                "attach.device_add_failed",
                e.message,
                layer="backend",
                details={"device_id": dev.device_id, "driver": dev.driver},
                status=500,
            ) from e
        self.added[qid] = dev
        seen: list[PciFunction] = self._wait_visible(agent, dev, before, t0 + VISIBLE_TIMEOUT_S) if waits else []
        deadline = t0 + VISIBLE_TIMEOUT_S
        while not seen:
            seen = [d for d in agent.pci_devices() if self._is_new(d, dev, before)]
            if seen:
                break
            if time.monotonic() > deadline:
                raise CubeError(
                    "attach.not_visible_in_guest",
                    f"guest does not see {dev.vendor_device} {VISIBLE_TIMEOUT_S:.0f} s after device_add",
                    layer="guest_kernel",
                    details={"device_id": dev.device_id},
                    status=500,
                )
            time.sleep(0.02)
        address = seen[0].address
        if self._known is not None:
            self._known.add(address)
        self.guest_addresses[dev.device_id] = address
        placed = self._confirm_bars(agent, dev, address, slot=index)
        self.reporter.report(
            DeviceAttached(
                qdev_id=qid,
                bus=att.bus,
                guest_address=address,
                vendor_device=dev.vendor_device,
                bars=dev.bars,
                guest_bars=placed,
                hotplug_ms=round((time.monotonic() - t0) * 1000, 1),
            ),
            (dev.device_id,),
        )

    def _confirm_bars(self, agent: AgentClient, dev: DeviceSpec, address: str, slot: int) -> list[PlacedBar]:
        """Attached means usable: the guest placed every memory BAR at its size, read from its own `resource`.

        The kernel may still be placing them when the function appears, so the guest is asked again until
        `BAR_SETTLE_S`; a BAR it found no room for reads as zeros for good. Returns where the guest placed them."""
        if not dev.bars:
            return []  # a record from before BARs were read: vendor:device is all there is to check
        if "pci_resources" not in self._agent_methods:
            raise CubeError(
                "attach.bars_unverifiable",
                f"the guest agent cannot report the BARs of {dev.vendor_device}; this image predates the check",
                layer="backend",
                details={"device_id": dev.device_id, "guest_address": address},
                status=500,
            )
        deadline = time.monotonic() + BAR_SETTLE_S
        while True:
            text = agent.pci_resources(address, timeout_s=10.0, cancel_fd=self._wake_r).resource
            misses = unassigned_bars(dev.bars, text)
            if not misses:
                lines = {line.index: line for line in parse_resource_lines(text)}
                return [
                    PlacedBar(bar=f"BAR{b.index}", start=f"0x{lines[b.index].start:x}", size=lines[b.index].size)
                    for b in dev.bars
                    if b.index in lines and lines[b.index].assigned
                ]
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        port = self.vmm.cfg.machine.ports[slot] if self.vmm is not None else None
        first = misses[0]
        raise CubeError(
            "attach.bar_unassigned",
            f"the guest could not place {first.bar.name} of {dev.vendor_device} at {address}: {first.reason}"
            + (f"; its root port reserved {human_bytes(port.pref64_bytes)} prefetchable" if port else ""),
            layer="backend",
            details={
                "device_id": dev.device_id,
                "guest_address": address,
                "bar": f"BAR{first.bar.index}",
                "bars": [m.to_json() for m in misses],
                "root_port": None
                if port is None
                else {"pref64_bytes": port.pref64_bytes, "mem32_bytes": port.mem32_bytes},
            },
            status=500,
        )

    @staticmethod
    def _is_new(d: PciFunction, dev: DeviceSpec, before: set[str]) -> bool:
        """The guest says so, and it is untrusted: the host checks vendor:device and novelty itself."""
        return d.vendor_device == dev.vendor_device and d.address not in before

    def _wait_visible(
        self, agent: AgentClient, dev: DeviceSpec, before: set[str], deadline: float
    ) -> list[PciFunction]:
        """One `wait_pci` the guest answers when the function appears ([] when it says it did not: the polling
        path then decides, until the same deadline)."""
        vendor, _, device = dev.vendor_device.partition(":")
        left = max(0.1, deadline - time.monotonic())
        params = WaitPciParams(vendor, device, tuple(sorted(before)), round(left, 3))
        found = agent.wait_pci(params, timeout_s=left + 5.0, cancel_fd=self._wake_r).device
        return [found] if found is not None and self._is_new(found, dev, before) else []

    def _probe_contract(self) -> dict[str, object]:
        """The frozen contract, or the minimum the host knows: its devices' vendor:device (Cubelet also checks
        that each is at the guest address the shim saw it appear at)."""
        if self.spec.contract is not None:
            return self.spec.contract.to_json()  # as CubeMaster froze it: the agent reads its guest_probes
        pci = [{"vendor_id": f"{d.vendor_id:04x}", "device_id": f"{d.device_id_hex:04x}"} for d in self.spec.devices]
        return {"probes": {"pci": pci}}

    def _validate(self, agent: AgentClient) -> None:
        ids = tuple(d.device_id for d in self.spec.devices)
        contract = self._probe_contract()
        try:
            scale = host_deadline_scale()
            reply = agent.probe(
                ProbeParams(contract, deadline_scale=scale),
                timeout_s=probe_timeout_s(contract, scale),
                cancel_fd=self._wake_r,
            )
        except CubeError as e:
            if e.code == "agent.cancelled":  # teardown was asked for: not a verdict on the guest
                raise
            self.reporter.report(GuestValidationFailed(reason=e.code, layer=e.layer, message=e.message), ids)
            raise
        if reply.ok:
            self.reporter.report(GuestValidated(report=reply.report), ids)
            return
        failed_layers = list(reply.failed_layers)
        self.reporter.report(
            GuestValidationFailed(report=reply.report, violations=reply.violations, failed_layers=failed_layers),
            ids,
        )
        raise CubeError(
            "guest.validation_failed",
            "guest does not satisfy the contract",
            layer="guest_kernel",
            details={"failed_layers": failed_layers},
        )

    def _scrub(self) -> tuple[int, str]:
        """The scrub VM's work after attach: the agent scrubs each device, the result is reported, the VM goes."""
        assert self.agent is not None and self.spec.scrub is not None
        t = time.monotonic()
        ok = True
        for dev in self.spec.devices:
            params: dict[str, object] = {**self.spec.scrub_params, "method": self.spec.scrub}
            if self.vendor_modules:  # a vendor image's scrub goes through that vendor's driver: loaded first
                params["modules"] = list(self.vendor_modules)
            if self.spec.scrub != "cuda":  # a BAR method works on the device's function in the guest
                params["address"] = self.guest_addresses[dev.device_id]
            try:
                result = self.agent.scrub(params, timeout_s=SCRUB_TIMEOUT_S, cancel_fd=self._wake_r)
            except CubeError as e:
                result = {"ok": False, "method": self.spec.scrub, "error": f"{e.code}: {e.message}"[:500]}
            try:
                evidence = ScrubReport.model_validate(result).evidence()  # the typed evidence, checked here first
            except ValueError as e:
                result, evidence = {"ok": False, "error": f"malformed scrub result: {e}"[:500]}, {}
            ok = ok and bool(result.get("ok"))
            self.reporter.report(
                ScrubFinished(result=result, evidence=evidence, image_digest=self.image_digest), (dev.device_id,)
            )
        self._phase("scrub_s", t)
        return (0, "scrubbed") if ok else (1, "release.scrub_failed")

    def _wait(self) -> None:
        """Until SIGTERM or the VMM exits on its own (guest poweroff, crash, someone killed it)."""
        assert self.vmm is not None
        pidfd = os.pidfd_open(self.vmm.pid)
        try:
            while not self._stop and self.vmm.poll_exit() is None:
                select.select([pidfd, self._wake_r], [], [], 1.0)
        finally:
            os.close(pidfd)

    # -- teardown --------------------------------------------------------------------------------------------
    def _teardown(self) -> ExitInfo | None:
        vmm = self.vmm
        if vmm is None:
            return None
        t = time.monotonic()
        alive = vmm.poll_exit() is None
        if self.control is not None:
            self.control.close()
        if self.bridge is not None:  # workload connections end first; the guest kills their commands
            self.bridge.close()
        with self._agent_lock:
            if alive and self.agent is not None:
                with contextlib.suppress(Exception):  # the guest is untrusted: nothing it says stops the teardown
                    self.agent.shutdown(
                        ShutdownParams(poweroff=False),
                        timeout_s=min(AGENT_SHUTDOWN_TIMEOUT_S, self.spec.detach_timeout_s),
                    )
            if self.agent is not None:
                self.agent.close()
        if alive and self.added:
            self._detach(vmm)
        t = self._phase("detach_s", t)
        info = vmm.stop(STOP_GRACE_S)
        self._phase("vmm_exit_s", t)
        if info.how != "unreaped":  # the scratch disk goes with the VMM (the release path makes sure of it)
            scratch.remove_scratch(self.spec.run_dir)
        if info.how != "unreaped":  # never report an exit the kernel has not confirmed
            self.reporter.report(exit_details(info), tuple(d.device_id for d in self.spec.devices))
        return info

    def _detach(self, vmm: QemuVmm) -> None:
        t0 = time.monotonic()
        requested: set[str] = set()
        for qid in self.added:
            try:
                vmm.request_remove(qid)
                requested.add(qid)
            except CubeError as e:
                self.reporter.report(
                    DetachTimeout(qdev_id=qid, reason=e.code, message=e.message), (self.added[qid].device_id,)
                )
        removed = vmm.wait_removed(requested, self.spec.detach_timeout_s)
        for qid in sorted(requested):
            dev = self.added[qid]
            if qid in removed:
                self.reporter.report(
                    DeviceDetached(qdev_id=qid, detach_ms=round((time.monotonic() - t0) * 1000, 1)), (dev.device_id,)
                )
            else:
                self.reporter.report(DetachTimeout(qdev_id=qid, timeout_s=self.spec.detach_timeout_s), (dev.device_id,))


def read_workload_token() -> str | None:
    """The token line Cubelet writes to the shim's stdin (and closes); None when stdin is a terminal or empty."""
    if sys.stdin is None or sys.stdin.isatty():
        return None
    line = sys.stdin.buffer.readline(512).strip()
    return line.decode("ascii", errors="replace") or None


def run_shim(spec: ShimSpec, log_level: str | None = None, workload_token: str | None = None) -> int:
    """`workload_token`: given by the fork server; a spawned shim reads it from stdin."""
    set_request_id(spec.request_id)  # every log line and report of this shim carries the starting request's id
    configure_logging(log_level)
    private_umask()  # its dir, QMP/agent sockets, logs and the template snapshot QEMU writes: owner-only
    if spec.workload and workload_token is None:
        workload_token = read_workload_token()
    return Shim(spec, workload_token if spec.workload else None).run()
