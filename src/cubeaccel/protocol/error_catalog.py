"""Every error and reason code cubeaccel emits: its HTTP status, the layer it names, one line of meaning.

One fact, one place: docs/api.md's error table is generated from `CODES` (`python -m
cubeaccel.protocol.error_catalog --markdown`, checked by tests/unit/test_error_catalog.py), the API edge takes an
error's HTTP status from here, and a test fails when code under src/ emits a code that is not listed.

`status` is the HTTP status of a reply whose `error.code` is this code. `None` means the code is never the
top-level code of an HTTP error: it is a sandbox failure / device reason / violation / host problem inside a
body, a guest-side (agent protocol) error, or a CLI-only error — or, for `api.http_error` and `http.error`,
the status is whatever the HTTP layer chose. Where the layer varies with the caller, `layer` names the usual
one and the error's own `layer` field is authoritative.

Stdlib only: the guest agent imports `protocol.errors`, which imports this. Adding a code is one line in `CODES`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class CodeInfo:
    code: str
    status: int | None
    layer: str
    meaning: str


def _c(code: str, status: int | None, layer: str, meaning: str) -> CodeInfo:
    return CodeInfo(code, status, layer, meaning)


# fmt: off
CODES: tuple[CodeInfo, ...] = (
    # ---- API edge (Cubelet and CubeMaster) ----
    _c("api.internal_error", 500, "api", "a bug in the E2B front door: the exception is logged, never sent"),
    _c("api.bad_http_request", 400, "api", "an HTTP request that does not parse (bad framing, a malformed header)"),
    _c("api.headers_too_large", 431, "api", "request line and headers over 16 KiB (counted on the parsed request)"),
    _c("api.body_timeout", 408, "api", "the request body did not arrive within the body deadline (30 s)"),
    _c("api.body_too_large", 413, "api", "request body over 1 MiB, counted on the bytes read (chunked too)"),
    _c("api.http_error", None, "api", "any other HTTP error raised by the framework; status as the framework chose"),
    _c("api.byte_order_mark", 422, "api", "a JSON body starts with a UTF-8 byte-order mark"),
    _c("api.duplicate_key", 422, "api", "a JSON object names one key twice"),
    _c("api.invalid_cursor", 422, "api", "events `since` cursor is not a non-negative integer"),
    _c("api.invalid_request", 422, "api", "request body or query fails validation (type, range, missing field)"),
    _c("api.invalid_shim_report", 422, "api", "a shim report body that does not parse"),
    _c("api.invalid_state", 422, "api", "sandbox list filtered by a state that does not exist"),
    _c("api.malformed_json", 422, "api", "request body is not valid JSON"),
    _c("api.method_not_allowed", 405, "api", "the route exists but not with this method"),
    _c("api.non_finite_number", 422, "api", "NaN, Infinity or a number too large for a double (1e400) in JSON"),
    _c("api.not_found", 404, "api", "no such route"),
    _c("api.number_out_of_range", 422, "api", "an integer in a free-form field (report details) beyond ±2^63"),
    _c("api.too_deep", 422, "api", "JSON nested deeper than 32 levels"),
    _c("api.too_many_values", None, "api", "a value holds more items than its bound (templates: template.too_large)"),
    _c("api.unknown_field", 422, "api", "request body has a field the API does not define"),
    _c("api.unsupported_version", 422, "api", "a request body's `v` is not 1"),
    _c("api.unsupported_reply_version", 502, "api", "a client got a reply whose `v` it does not read"),
    _c("api.unknown_verb", 404, "api", "operator/maintenance verb that does not exist"),
    _c("http.error", None, "api", "client side: an error reply without a cubeaccel error body; status as received"),
    # ---- Cubelet: devices, reservations, operator ----
    _c("device.in_use", 409, "cubelet", "operator verb on a device that a sandbox holds"),
    _c("device.invalid_address", 422, "api", "not a PCI address DDDD:BB:DD.F (layer host_hardware from sysfs)"),
    _c("device.invalid_id", 422, "api", "device id is not `<backend>-<pci address>`"),
    _c("device.not_found", 404, "api", "no device with this id"),
    _c("reservation.not_found", 404, "api", "no reservation for this sandbox id"),
    _c("reserve.expired", None, "cubelet", "failure: a reservation never started before its TTL"),
    _c("reserve.insufficient_devices", 409, "cubelet", "not enough allocatable matching devices for the request"),
    _c("reserve.invalid_contract", 422, "template", "the frozen contract sent with a reservation does not parse"),
    _c("reserve.invalid_count", 422, "api", "device count out of range"),
    _c("reserve.invalid_sandbox_id", 422, "api", "sandbox id is not 1-64 of letters, digits and `_.-`"),
    _c("reserve.pinned_memory_exhausted", 409, "pinned_memory", "guest RAM + VMM overhead over free lockable memory"),
    _c("reserve.pinned_memory_over_rlimit", 409, "pinned_memory", "the sandbox would lock over RLIMIT_MEMLOCK"),
    _c("reserve.sandbox_conflict", 409, "cubelet", "the sandbox id is reserved with different parameters"),
    # ---- warm sandboxes (docs/warm.md) ----
    _c("warm.no_match", 409, "cubelet", "no warm sandbox matches the claim; `details.reason` names why (cold path)"),
    _c("warm.no_pool", None, "cubelet", "miss reason: this node keeps no warm pool of the request's shape"),
    _c("warm.pool_empty", None, "cubelet", "miss reason: the pool is being refilled (none warm now)"),
    _c("warm.reserved_id", 409, "cubelet", "a claim or reservation named an id in the node's own warm-* namespace"),
    _c("warm.claim_unanswered", 503, "cubelet", "the warm shim did not answer the claim (it is torn down)"),
    _c("warm.claim_malformed", None, "cubelet", "a warm shim's answer to a claim line it could not read"),
    _c("warm.already_claimed", 503, "cubelet", "a warm shim refused a second claim (it stays its first tenant's)"),
    _c("warm.claim_unacknowledged", None, "cubelet", "reconcile: claimed, never acked by its shim: failed"),
    _c("warm.superseded", None, "cubelet", "a pool replaced by its template's new version: its warm ones torn down"),
    _c("warm.drained", None, "cubelet", "drain or `cubeaccel down`: unclaimed warm ones torn down; claims miss"),
    _c("warm.claim_failed", None, "scheduler", "miss reason: a warm claim was tried and handed nothing over (cold)"),
    _c("sandbox.releasing", 409, "cubelet", "the sandbox is being torn down; retry after the release"),
    _c("sandbox_deleted", None, "cubelet", "failure: the sandbox was deleted (default release reason)"),
    _c("vmm_exited", None, "cubelet", "failure: the VMM exited while the sandbox was in use"),
    _c("operator.audit_required", 422, "api", "operator verb without `who` and `why`"),
    _c("operator.audit_too_long", 422, "api", "operator `who`/`why` over the length limit"),
    _c("operator.disabled", None, "cubelet", "device reason: an operator disabled the device"),
    _c("operator.not_recoverable", 409, "cubelet", "recover on a device that is not quarantined or unhealthy"),
    _c("operator.quarantine", None, "cubelet", "device reason: an operator quarantined the device"),
    _c("recover.validation_failed", 409, "host_hardware", "recover refused: the device fails revalidation now"),
    _c("recover.vmm_alive", 409, "cubelet", "recover refused: the device's last VMM is not proven gone"),
    _c("prepare.revalidation_failed", 409, "host_hardware", "the device failed revalidation at start (also a failure)"),
    _c("state.actor_not_allowed", 409, "cubelet", "this actor may not fire this device event"),
    _c("state.transition_refused", 409, "cubelet", "the device state machine refuses this event in this state"),
    _c("store.migration_failed", 500, "cubelet", "a stored row does not convert to the new schema (store unchanged)"),
    _c("store.closed", 500, "cubelet", "a change was attempted after the store was closed (shutdown)"),
    _c("store.commit_failed", 500, "cubelet", "a change's durable commit failed (disk full, I/O): not made"),
    _c("store.checkpoint_too_new", 500, "cubelet", "a reservation checkpoint written by a newer cubeaccel"),
    _c("reservation.transition_refused", 409, "cubelet", "the reservation phase table refuses this event now"),
    _c("reservation.actor_not_allowed", 409, "cubelet", "this actor may not fire this reservation event"),
    _c("sandbox.transition_refused", 409, "api", "the sandbox state table refuses this event now (a bug)"),
    _c("sandbox.actor_not_allowed", 409, "api", "this actor may not fire this sandbox event (a bug)"),
    _c("node.transition_refused", 409, "api", "the node state table refuses this event now"),
    _c("node.actor_not_allowed", 409, "api", "this actor may not fire this node event"),
    _c("store.schema_too_new", 500, "cubelet", "the state database was written by a newer cubeaccel"),
    _c("store.stale_record", 409, "cubelet", "compare-and-swap lost: the device changed underneath"),
    _c("cubelet.guest_images_simulated_only", 422, "api", "Cubelet config: listed guest images need the simulated VMM"),
    _c("cubelet.invalid_guest_images", 422, "api", "Cubelet config: the guest image list does not parse"),
    _c("cubelet.invalid_instance_id", 422, "cubelet", "Cubelet config: instance id is not a valid identifier"),
    _c("cubelet.invalid_vm_start", 422, "api", "Cubelet config: unknown VM start mode"),
    _c("cubelet.invalid_shim_launch", 422, "api", "Cubelet config: unknown shim launch mode (fork or spawn)"),
    _c("cubelet.unknown_backend", 422, "backend", "Cubelet config: no such backend"),
    # ---- Cubelet: release, reconcile (sandbox failures and device reasons) ----
    _c("release.device_node_not_returned", None, "cubelet", "quarantine: a VMM's device node was not taken back"),
    _c("release.holder_stuck", None, "cubelet", "quarantine: a process still holds the device after the release"),
    _c("release.holder_unknown", None, "cubelet", "quarantine: a process whose fds cannot be read may hold the device"),
    _c("release.vmm_not_exited", None, "cubelet", "quarantine: the VMM did not exit within the release deadline"),
    _c("release.vmm_state_unknown", None, "cubelet", "quarantine: whether the VMM still runs cannot be told"),
    _c("release.scrub_pending", None, "cubelet", "device reason: released, its scrub VM owed or running"),
    _c("release.scrub_failed", None, "cubelet", "quarantine: the scrub ran and did not verify, or timed out"),
    _c("release.scrub_vm_not_started", None, "cubelet", "quarantine: the scrub VM failed before scrubbing (retried)"),
    _c("release.scrub_image_unavailable", None, "cubelet",
       "quarantine: no usable scrub image to boot, nothing scrubbed (retried once the image is here)"),
    _c("cubelet.invalid_scrub_policy", 422, "api", "Cubelet config: --scrub is not CLASS=none|trusted-vm"),
    _c("reconcile.no_reservation", None, "cubelet", "device reason: a held device whose reservation is gone"),
    _c("reconcile.releasing_without_reservation", None, "cubelet", "device reason: releasing with no reservation"),
    _c("reconcile.shim_gone", None, "cubelet", "failure: the sandbox's shim is no longer running"),
    _c("reconcile.startup_timeout", None, "cubelet", "failure: the start did not finish within its deadline"),
    _c("reconcile.vmm_gone", None, "cubelet", "failure: the sandbox's VMM is no longer running"),
    _c("reconcile.vmm_state_unknown", None, "cubelet", "quarantine: reconcile cannot tell whether the VMM runs"),
    # ---- host readiness and device health (host problems, device reasons) ----
    _c("host.aer_fatal", None, "host_hardware", "device reason: new fatal AER errors since the baseline"),
    _c("host.bind_failed", 500, "host_hardware", "binding the device to a driver failed"),
    _c("host.device_disabled", None, "host_hardware", "device reason: the device is in a PCI error state"),
    _c("host.device_held", None, "host_hardware", "device reason: a process outside cubeaccel holds the device"),
    _c("host.device_missing", 500, "host_hardware", "the device is gone from the host (also a device reason, failure)"),
    _c("host.device_not_responding", None, "host_hardware", "device reason: config space reads 0xffff"),
    _c("host.identity_changed", None, "host_hardware", "device reason: vendor/device/serial differ from registration"),
    _c("host.invalid_attribute", 422, "host_hardware", "a sysfs attribute has an unexpected value"),
    _c("host.invalid_reset_method", 422, "host_hardware", "not one of the kernel's reset method names"),
    _c("host.invalid_driver_name", 422, "api", "not a valid kernel driver name"),
    _c("host.invalid_iommu_group", 422, "host_hardware", "the iommu_group link does not name a group number"),
    _c("host.invalid_profile", 422, "host_hardware", "a simulated host profile does not parse"),
    _c("host.no_interrupt_remapping", None, "host_hardware", "host problem: no IRQ remapping and no unsafe opt-in"),
    _c("host.no_iommu", None, "host_hardware", "host problem: /sys/kernel/iommu_groups is empty"),
    _c("host.no_kvm", None, "host_hardware", "host problem: /dev/kvm is missing"),
    _c("host.no_vfio_device", None, "host_hardware", "host problem: /dev/vfio/vfio is missing"),
    _c("host.not_checked", None, "host_hardware", "host problem: readiness has not been checked yet"),
    _c("host.not_ready", 409, "host_hardware", "the backend's host checks fail; details.problems lists the host codes"),
    _c("host.pvm_unsupported", None, "host_hardware", "host problem: a PVM (nested) host cannot pass devices through"),
    _c("host.qemu_missing", None, "host_hardware", "host problem (emulated): qemu-system-x86_64 is not installed"),
    _c("host.read_only", 500, "host_hardware", "the sysfs tree is read-only (a test or inspection root)"),
    _c("host.no_reset_method", 500, "host_hardware", "the function has no reset method (no `reset` attribute)"),
    _c("host.reset_failed", 500, "host_hardware", "the device reset failed"),
    _c("host.restore_failed", 500, "host_hardware", "restoring the device's original driver failed"),
    _c("host.unexpected_holder", None, "host_hardware", "device reason: an unknown process opened the VFIO group"),
    _c("host.unknown_profile", 422, "host_hardware", "no simulated host profile with this name"),
    _c("host.unsafe_interrupts", None, "host_hardware", "host problem: unsafe interrupts are allowed (warned)"),
    _c("host.vfio_pci_unavailable", None, "host_hardware", "host problem: the vfio-pci driver is not registered"),
    _c("host.write_failed", 500, "host_hardware", "a sysfs write failed"),
    # ---- backends (device reasons) ----
    _c("backend.bind_failed", None, "backend", "device reason: binding to vfio-pci failed"),
    _c("backend.boot_vga", None, "backend", "device reason: the device drives the host console; not unbound"),
    _c("backend.invalid_allow_pattern", 422, "api", "a VFIO allow-list pattern does not parse"),
    _c("backend.iommu_group_not_viable", None, "backend", "device reason: another group member is not vfio-bound"),
    _c("backend.no_iommu_group", None, "backend", "device reason: the device has no IOMMU group"),
    _c("host.no_scrub_method", None, "backend",
       "device reason: no scrub method known for its kind under trusted-vm; held until a --scrub policy"),
    _c("host.scrub_image_missing", None, "backend",
       "device reason, host problem, host check: no built scrub image of its stack carries this release's agent; held"),
    _c("host.scrub_image_mismatch", None, "backend",
       "device reason, host problem, host check: the scrub image's files differ from its pinned digests; held"),
    _c("backend.nvswitch_fabric_unmanaged", None, "backend",
       "device reason, host check: a GPU on an NVSwitch (HGX) fabric, held initialized (no Fabric Manager partitions)"),
    _c("backend.qemu_missing", None, "backend", "device reason (emulated): QEMU is not installed"),
    _c("backend.no_reset_method", None, "backend", "device reason: no reset method, cannot be cleared between tenants"),
    _c("backend.reset_failed", None, "backend", "device reason: the reset at release failed"),
    _c("backend.reset_not_allowed", None, "backend", "device reason: no safe reset method for this device"),
    _c("backend.bus_reset_refused", None, "backend", "device reason: bus reset would reach a busy or foreign function"),
    _c("backend.bus_reset_unavailable", None, "backend", "device reason: the kernel offers no bus reset here"),
    _c("backend.no_bus_reset", None, "backend", "device reason: on a root bus, no bridge whose bus could be reset"),
    _c("backend.reset_check_failed", None, "backend", "a rung's post-reset identity and health check failed"),
    _c("backend.restore_failed", None, "backend", "device reason: the original driver could not be restored"),
    _c("backend.restore_unsupported", None, "backend", "device reason: this host cannot leave a device unbound"),
    _c("backend.vfio_unavailable", None, "backend", "device reason: the vfio-pci driver is not available"),
    _c("backend.vmm_still_running", None, "backend", "device reason (emulated): a VMM still uses the device"),
    _c("backend.wrong_driver", None, "backend", "device reason: the device is bound to another driver than expected"),
    # ---- shim, VMM, attach (sandbox failures) ----
    _c("attach.device_add_failed", None, "backend", "failure: the VMM refused to hot-plug the device"),
    _c("attach.not_visible_in_guest", None, "guest_kernel", "failure: the hot-plugged device never showed up"),
    _c("attach.bar_unassigned", None, "backend", "failure: the guest could not place a BAR at its size (details.bar)"),
    _c("attach.bars_unverifiable", None, "backend", "failure: the guest agent cannot report BARs (an older image)"),
    _c("shim.coldplug_unsupported", None, "backend", "failure: template expects cold-plug; the shim hot-plugs"),
    _c("shim.image_not_found", None, "template", "failure: the pinned guest image is not on this node"),
    _c("shim.internal_error", None, "cubelet", "failure: the shim crashed (a bug or a hostile guest reply)"),
    _c("shim.invalid_spec", None, "template", "the shim's spec file does not parse (CLI and shim start)"),
    _c("shim.launch_failed", None, "cubelet", "failure: the shim process could not be launched"),
    _c("shim.no_image", None, "template", "failure: the shim spec names no guest image"),
    _c("shim.report_stale", None, "cubelet", "event reason: a shim report from an earlier start was ignored"),
    _c("shim.stop_requested", None, "cubelet", "teardown was requested during startup (not a failure of the VM)"),
    _c("pinned_memory.lock_failed", None, "pinned_memory", "failure: the VMM could not lock guest RAM"),
    _c("pinned_memory.lock_unavailable", None, "pinned_memory", "failure: no way for a VMM to lock memory here"),
    _c("pinned_memory.not_locked", None, "pinned_memory", "failure: guest RAM is not locked after start"),
    _c("lifecycle.snapshot_with_device", 409, "backend", "a VM holding a device is never saved as a template state"),
    _c("lifecycle.unknown_operation", 409, "backend", "a lifecycle operation cubeaccel does not know"),
    _c("lifecycle.unsupported_for_accelerator", 409, "backend", "pause/snapshot/migrate refused for GPU sandboxes"),
    _c("vmm.address_space_exceeded", None, "backend", "failure: the BARs need more guest address bits than exist"),
    _c("vmm.hotplug_unsupported", None, "backend", "failure: this node's VMM cannot hot-plug PCI devices"),
    _c("vmm.not_started", None, "backend", "the VMM driver was used before start (a bug)"),
    _c("vmm.qemu_missing", None, "backend", "failure: qemu-system-x86_64 is not installed"),
    _c("vmm.qmp_error", None, "backend", "failure: QEMU answered a QMP command with an error"),
    _c("vmm.qmp_failed", None, "backend", "failure: the QMP socket broke"),
    _c("vmm.qmp_timeout", None, "backend", "failure: QEMU did not answer QMP in time"),
    _c("vmm.restore_failed", None, "backend", "failure: restoring the template state failed"),
    _c("vmm.save_failed", None, "backend", "saving a template state failed"),
    _c("vmm.confine_config", None, "backend", "failure: the VMM confinement settings (CUBEACCEL_VMM_*) are invalid"),
    _c("vmm.confinement_failed", None, "backend", "failure: the VMM could not be confined: it never ran"),
    _c("vmm.device_node_refused", None, "backend", "failure: a VMM device node is a symlink"),
    _c("vmm.no_uid", None, "backend", "failure: every uid of the VMM uid range is in use"),
    _c("vmm.not_confined", None, "backend", "failure: /proc shows the VMM not confined as launched"),
    _c("vmm.start_failed", None, "backend", "failure: the VMM process could not start or exited early"),
    _c("vmm.status_timeout", None, "backend", "failure: QEMU did not report its run state in time"),
    # ---- shim ↔ cube-agent (shim side: sandbox failures) ----
    _c("agent.bad_reply", None, "guest_kernel", "failure: cube-agent sent a reply that does not parse"),
    _c("agent.cancelled", None, "cubelet", "a stop arrived during guest validation (no verdict)"),
    _c("agent.connect_failed", None, "guest_kernel", "failure: the agent port could not be opened"),
    _c("agent.disconnected", None, "guest_kernel", "failure: cube-agent closed the port"),
    _c("agent.error", None, "agent", "failure: the agent replied with a code it never sends (`details.guest_code`)"),
    _c("agent.not_connected", None, "guest_kernel", "the agent client was used before connecting (a bug)"),
    _c("agent.not_ready", None, "guest_kernel", "failure: cube-agent did not answer hello in time"),
    _c("agent.reply_too_large", None, "guest_kernel", "failure: a cube-agent reply over the size limit"),
    _c("agent.timeout", None, "guest_kernel", "failure: cube-agent did not answer in time"),
    # ---- cube-agent (guest side: protocol errors in the agent's replies) ----
    _c("agent.bad_json", None, "agent", "guest: the line is not UTF-8 JSON (also: nesting too deep)"),
    _c("agent.bad_request", None, "agent", "guest: not an object, or `id` not an integer/short string"),
    _c("agent.internal_error", None, "agent", "guest: a handler bug; reported, and the next request is served"),
    _c("agent.invalid_contract", None, "template", "guest: the contract is missing or malformed"),
    _c("agent.invalid_params", None, "agent", "guest: `params` not an object, or a flag not a boolean"),
    _c("mux.bad_version", 502, "workload", "guest channel: header version is not 1"),
    _c("mux.unknown_type", 502, "workload", "guest channel: frame type not 0-5"),
    _c("mux.bad_flags", 502, "workload", "guest channel: flags other than PING's ACK"),
    _c("mux.oversize", 502, "workload", "guest channel: DATA length above `max_frame` (seen from the header alone)"),
    _c("mux.truncated", 502, "workload", "guest channel: the channel ended inside a frame"),
    _c("mux.window_exceeded", 502, "workload", "guest channel: the peer sent more DATA than its credit on a stream"),
    _c("mux.window_overflow", 502, "workload", "guest channel: a WINDOW would push credit above 2**31-1"),
    _c("mux.protocol", 502, "workload", "guest channel: a framing rule broken (docs/workload.md lists them)"),
    _c("mux.flood", 502, "workload", "guest channel: unsent control output above `max_control_backlog`"),
    _c("mux.session_closed", 502, "workload", "guest channel: a local call after the session ended"),
    _c("workload.not_up", 502, "workload", "the guest's workload service did not answer on its channel (start fails)"),
    _c("workload.no_token", 502, "workload", "the shim was asked to bridge the workload service but got no token"),
    _c("workload.channel_unreachable", 502, "workload", "the VMM's workload port socket cannot be connected"),
    _c("workload.channel_closed", 502, "workload", "the workload channel to the guest ended (a new stream is refused)"),
    _c("workload.unresponsive", 503, "workload", "the guest's workload service stopped answering (PINGs unanswered)"),
    _c("workload.unauthenticated", 401, "api", "workload proxy: missing or wrong sandbox access token"),
    _c("workload.not_running", 409, "api", "workload proxy: the sandbox is not running on this node"),
    _c("workload.unavailable", 503, "api", "workload proxy: the sandbox's workload endpoint cannot be reached"),
    _c("workload.token_unavailable", 409, "api", "connect: the sandbox's creator chose its token (not CubeMaster's)"),
    _c("sandbox.not_live", 409, "api", "a lifetime change for a sandbox that is no longer starting or running"),
    _c("workload.refused", None, "workload", "the workload service refused a call (`connect_code` names envd's code)"),
    _c("workload.bad_reply", None, "workload", "the workload service's reply does not parse as envd's protocol"),
    _c("mux.stream_closed", 502, "workload", "guest channel: a local send on a stream that is closed for sending"),
    _c("guest.port_not_found", None, "agent", "guest: no virtio port with this name (agent or workload service)"),
    _c("agent.probe_crashed", None, "agent", "guest: a probe raised instead of returning a verdict"),
    _c("agent.read_timeout", None, "agent", "guest: an unfinished line sat for --read-timeout seconds; dropped"),
    _c("agent.request_too_large", None, "agent", "guest: a line over --max-request-bytes; the rest is skipped"),
    _c("agent.reseed_failed", None, "agent", "guest: the warm claim's seed could not be written to /dev/urandom"),
    _c("agent.unknown_method", None, "agent", "guest: method not in the list; `details.methods` lists them"),
    _c("agent.unsupported_version", None, "agent", "guest: `v` is not 1 (a missing `v` is read as 1)"),
    # ---- guest validation (stage 5, judged on the host) ----
    _c("guest.report_malformed", None, "guest_kernel", "failure: the agent's GuestReport does not parse"),
    _c("guest.validation_failed", None, "guest_kernel", "failure: the guest does not satisfy the contract"),
    # ---- contract stage 1: registration (`check_template`; 422 when a frozen contract fails it) ----
    _c("compat.backend_unknown", 422, "backend", "template names a backend that does not exist"),
    _c("compat.coldplug_unsupported", 422, "backend", "template asks for cold-plug; only hot-plug is supported"),
    _c("compat.cuda_driver_too_old", 422, "cuda_runtime", "the driver is older than the CUDA release needs"),
    _c("compat.cuda_invalid_compatibility", 422, "cuda_runtime", "CUDA compatibility not toolkit/minor_version"),
    _c("compat.cuda_invalid_version", 422, "cuda_runtime", "CUDA version is not like 12.4 or 12.4.1"),
    _c("compat.cuda_unknown_version", 422, "cuda_runtime", "CUDA version not in the toolkit → driver table"),
    _c("compat.guest_kernel_digest_malformed", 422, "guest_kernel", "kernel digest is not sha256:<64 hex>"),
    _c("compat.guest_kernel_invalid_version", 422, "guest_kernel", "kernel version is not a kernel release"),
    _c("compat.host_hardware_none_listed", 422, "host_hardware", "template lists no supported device"),
    _c("compat.host_hardware_not_cuda_capable", 422, "host_hardware", "CUDA set, a listed device is not CUDA-capable"),
    _c("compat.kernel_driver_arch_unsupported", 422, "kernel_driver", "driver too old for a device's architecture"),
    _c("compat.kernel_driver_invalid_module", 422, "kernel_driver", "kernel module is not a module name"),
    _c("compat.kernel_driver_invalid_version", 422, "kernel_driver", "kernel driver version is not like 550.54.15"),
    _c("compat.kernel_driver_missing", 422, "kernel_driver", "CUDA is set but no kernel driver is named"),
    _c("compat.modules_img_digest_malformed", 422, "modules_img", "modules.img digest is not sha256:<64 hex>"),
    _c("compat.modules_img_kernel_mismatch", 422, "modules_img", "modules.img built for another kernel"),
    _c("compat.persistence_mode_needs_userspace_driver", 422, "userspace_driver", "persistence mode without NVML"),
    _c("compat.pinned_memory_required", 422, "pinned_memory", "vfio hot-plug needs memory.pinned: true"),
    _c("compat.pinned_memory_size_invalid", 422, "pinned_memory", "guest memory size out of range"),
    _c("compat.template_image_digest_malformed", 422, "template", "image digest is not sha256:<64 hex>"),
    _c("compat.template_invalid_name", 422, "template", "template name is not a DNS label"),
    _c("compat.template_invalid_version", 422, "template", "template version has characters outside A-Z a-z 0-9 . _ -"),
    _c("compat.template_probe_invalid", 422, "template", "a probe that is not a module, /dev path, soname"),
    # ---- sandbox policy (model/sandbox_policy.py, host/net/netpolicy.py; docs/untrusted-tool.md) ----
    _c("compat.unsupported_nested_virtualization", 422, "template", "nested virtualization in a device sandbox"),
    _c("compat.unsupported_privileged", 422, "template", "a privileged workload: refused in every sandbox"),
    _c("compat.unsupported_host_namespace", 422, "template", "a workload sharing a host namespace: refused"),
    _c("compat.unsupported_device_sharing", 422, "template", "MIG, vGPU or time slicing: one tenant per device"),
    _c("compat.unsupported_gpu_snapshot", 422, "template", "snapshot, clone or pause of a sandbox holding a device"),
    _c("compat.network_forbidden_destination", 422, "template", "egress to loopback/link-local/multicast/broadcast"),
    _c("compat.scratch_invalid_size", 422, "template", "scratch_mib outside 16 MiB..16 TiB"),
    _c("compat.mount_invalid", 422, "template", "a read-only mount with a bad or reserved path"),
    _c("port.invalid", 400, "api", "a sandbox port that is not 1-65535 (Host `<port>-<id>.D`, E2b-Sandbox-Port)"),
    _c("port.token_required", 403, "api", "a sandbox port asked without its traffic token or envd token (E2B: 403)"),
    _c("port.upgrade_unsupported", 501, "api", "Upgrade (WebSocket) to a sandbox port: plain HTTP/1.1 only"),
    _c("port.not_listening", 502, "workload", "nothing listens on that port on 127.0.0.1 inside the sandbox"),
    _c("port.bad_reply", 502, "workload", "the app on a sandbox port answered with no valid HTTP/1.x reply head"),
    _c("network.invalid_rule", 422, "template", "an egress rule that is not CIDR:port[/tcp|udp]"),
    _c("network.invalid_policy", 422, "template", "a network policy that is not {mode: none|allowlist, egress}"),
    _c("network.policy_widened", 422, "api", "a request asks for egress its template does not allow"),
    _c("network.policy_too_large", 422, "api", "allow_out/deny_out cut the template's allowlist into over 64 rules"),
    _c("network.e2b_option_unsupported", 400, "api", "an E2B network option with no equivalent (proxy, transforms)"),
    _c("network.e2b_destination_unsupported", 400, "api", "an E2B allowOut/denyOut entry that is not IPv4 (a domain)"),
    _c("network.pool_overlap", 409, "cubelet", "an egress rule reaches this node's sandbox address pool"),
    _c("network.unavailable", 409, "cubelet", "this node cannot build sandbox networks (no ip/nft, or disabled)"),
    _c("network.setup_failed", None, "cubelet", "sandbox error: the network namespace, TAP or rules failed"),
    _c("network.teardown_failed", None, "cubelet", "release: the sandbox's network namespace could not be removed"),
    _c("network.not_running", 409, "api", "a network policy change for a sandbox that is not running"),
    _c("network.no_nic", 409, "cubelet", "a policy change that needs a NIC the running sandbox was started without"),
    _c("filesystem.mount_not_allowlisted", 409, "cubelet", "a read-only mount source this node does not allowlist"),
    _c("filesystem.scratch_failed", None, "backend", "sandbox error: the scratch disk could not be created"),
    _c("compat.template_unknown_class", 422, "template", "template class is not gpu or accelerator"),
    _c(
        "compat.template_cpu_only_with_device_stack",
        422,
        "template",
        "a template without an accelerator lists devices, a driver, CUDA or hot-plug",
    ),
    _c("compat.userspace_driver_invalid_library", 422, "userspace_driver", "a listed library is not a soname"),
    _c("compat.userspace_driver_invalid_version", 422, "userspace_driver", "user-space version not like 550.54.15"),
    _c("compat.userspace_driver_mismatch", 422, "userspace_driver", "user-space and kernel driver versions differ"),
    _c("compat.userspace_driver_missing", 422, "userspace_driver", "CUDA is set but no user-space driver is named"),
    # ---- contract stage 2: scheduling (`check_node`; per-node reasons inside schedule.unschedulable) ----
    _c("compat.node_backend_unavailable", None, "backend", "scheduling: the node lacks the template's backend"),
    _c("compat.node_guest_image_unavailable", None, "template", "scheduling: the node does not cache the guest image"),
    _c("compat.node_guest_kernel_unavailable", None, "guest_kernel", "scheduling: the node lacks the guest kernel"),
    _c("compat.node_hotplug_unsupported", None, "backend", "scheduling: the node's VMM cannot hot-plug"),
    _c("compat.node_modules_img_unavailable", None, "modules_img", "scheduling: the image has another modules.img"),
    _c("compat.node_no_matching_device", None, "host_hardware", "scheduling: no free device matches the template"),
    _c("compat.node_pinned_memory_insufficient", None, "pinned_memory", "scheduling: not enough free lockable memory"),
    # ---- contract stage 3: reservation (`check_device`; 409 from Cubelet) ----
    _c("compat.device_backend_mismatch", 409, "backend", "the device is managed by another backend"),
    _c("compat.device_class_mismatch", 409, "host_hardware", "the device class differs from the template's"),
    _c("compat.device_label_mismatch", 409, "host_hardware", "a device label (model, architecture) differs"),
    _c("compat.device_memory_too_small", 409, "host_hardware", "the device has less memory than the template needs"),
    _c("compat.device_not_supported", 409, "host_hardware", "the device's vendor:device is not in the template"),
    _c("compat.pinned_memory_insufficient", 409, "pinned_memory", "the node cannot lock the guest's memory"),
    # ---- contract at start: the shim's image check (sandbox failures) ----
    _c("compat.guest_image_mismatch", None, "template", "failure: the guest image on the node is not the pinned one"),
    _c("compat.guest_kernel_digest_mismatch", None, "guest_kernel", "failure: the node's kernel is not the pinned one"),
    _c("compat.modules_img_mismatch", None, "modules_img", "failure: modules.img on the node is not the pinned one"),
    # ---- contract stage 5: guest (`check_guest`; sandbox failures) ----
    _c("compat.cuda_driver_api_invalid", None, "cuda_runtime", "failure: cuDriverGetVersion did not report a number"),
    _c("compat.cuda_driver_api_too_old", None, "cuda_runtime", "failure: the driver API is older than the contract's"),
    _c("compat.cuda_init_failed", None, "cuda_runtime", "failure: cuInit(0) failed in the guest"),
    _c("compat.cuda_no_device", None, "cuda_runtime", "failure: CUDA sees no device in the guest"),
    _c("compat.cuda_not_probed", None, "cuda_runtime", "failure: the report has no CUDA probe"),
    _c("compat.cuda_runtime_library_missing", None, "cuda_runtime", "failure: the CUDA runtime library did not load"),
    _c("compat.cuda_timeout", None, "cuda_runtime", "failure: a CUDA call did not return before its deadline"),
    _c("compat.device_not_visible_in_guest", None, "host_hardware", "failure: the device is not in the guest PCI tree"),
    _c("compat.guest_kernel_mismatch", None, "guest_kernel", "failure: the guest booted another kernel release"),
    _c("compat.kernel_driver_device_file_missing", None, "kernel_driver", "failure: a /dev node is missing"),
    _c("compat.kernel_driver_library_missing", None, "kernel_driver", "guest verdict: a library did not load"),
    _c("compat.kernel_driver_not_loaded", None, "kernel_driver", "failure: the kernel driver module is not loaded"),
    _c("compat.kernel_driver_load_failed", None, "kernel_driver", "failure: the driver module refused to load"),
    _c("compat.kernel_driver_version_mismatch", None, "kernel_driver", "failure: the module has another version"),
    _c("compat.modules_img_module_failed", None, "modules_img", "failure: modprobe failed for a module"),
    _c("compat.modules_img_library_missing", None, "modules_img", "guest verdict: a library did not load"),
    _c("compat.modules_img_module_missing", None, "modules_img", "failure: a module is neither loaded nor failed"),
    _c("compat.nvml_failed", None, "userspace_driver", "failure: NVML could not be initialised in the guest"),
    _c("compat.persistence_mode_off", None, "userspace_driver", "failure: persistence mode did not turn on"),
    _c("compat.userspace_driver_library_missing", None, "userspace_driver", "failure: a driver library did not load"),
    _c("compat.userspace_driver_version_mismatch", None, "userspace_driver", "failure: a library has another version"),
    _c("compat.userspace_driver_version_unknown", None, "userspace_driver", "failure: a library version is unreadable"),
    # ---- templates and stored contracts ----
    _c("start.cold_no_snapshot", None, "template", "start path: no snapshot of this shape prepared; cold"),
    _c("start.cold_policy_devices", None, "template", "start path: NIC, disk or mount: another machine; cold"),
    _c("start.cold_configured", None, "template", "start path: the node starts every sandbox cold (--vm-start cold)"),
    _c("template.prepare_failed", None, "template", "CLI / host init: a shape's template snapshot could not be made"),
    _c("template.invalid", 422, "template", "registration refused: stage 1 fails (layer: the violation's)"),
    _c("template.invalid_document", 422, "template", "a stored template document is missing a section"),
    _c("template.invalid_encoding", 422, "template", "the template file is not UTF-8"),
    _c("template.invalid_field", 422, "template", "a field has the wrong type or value"),
    _c("template.invalid_json", 422, "template", "a `{`-prefixed template that is not valid JSON"),
    _c("template.invalid_yaml", 422, "template", "the template is not valid (safe) YAML"),
    _c("template.missing_field", 422, "template", "a required field is missing"),
    _c("template.no_default", 422, "template", "no template given and none is marked default"),
    _c("template.not_a_mapping", 422, "template", "the document is a list, a scalar or empty"),
    _c("template.not_found", 404, "template", "no template with this name/version (or no such file)"),
    _c("template.not_a_file", 422, "template", "the template path is a device, FIFO or socket, not a regular file"),
    _c("template.too_deep", 422, "template", "the template document is nested deeper than 32 levels"),
    _c("template.too_large", 422, "template", "the template file is over 1 MiB (or expands to over 100,000 values)"),
    _c("template.unknown", 422, "template", "the sandbox request names a template that is not registered"),
    _c("template.unknown_field", 422, "template", "a field the schema does not define"),
    _c("template.unreadable", 422, "template", "the template path cannot be read"),
    _c("template.unsupported_api_version", 422, "template", "apiVersion is not cubeaccel/v1"),
    _c("template.version_exists", 409, "template", "this name/version is registered with another document"),
    _c("template.wrong_kind", 422, "template", "kind is not GpuTemplate"),
    _c("contract.digest_mismatch", 422, "template", "the stored contract's document was edited after freezing"),
    _c("contract.invalid_json", 422, "template", "a stored contract that is not a contract object"),
    _c("contract.unsupported_version", 422, "template", "contract_version this cubeaccel does not read"),
    _c("version.invalid_cuda", 422, "cuda_runtime", "not a CUDA version (12.4, 12.4.1) or driver API int"),
    _c("version.invalid_driver", 422, "kernel_driver", "not an NVIDIA driver version (550.54.15)"),
    _c("version.invalid_kernel", 422, "guest_kernel", "not a kernel release (6.1.0-27-cloud-amd64)"),
    # ---- CubeMaster ----
    _c("cubelet.unreachable", 502, "api", "CubeMaster could not reach the node's Cubelet"),
    _c("node.invalid_heartbeat", 422, "api", "a heartbeat body that does not parse"),
    _c("node.invalid_url", 422, "api", "cubelet_url is not http(s)://HOST:PORT"),
    _c("node.name_mismatch", 422, "api", "the heartbeat's node name differs from the URL's"),
    _c("node.not_found", 404, "api", "no node with this name"),
    _c("node.stale", 503, "api", "no heartbeat within the staleness bound: the dashboard shows its last summary"),
    _c("node.url_conflict", 409, "api", "another node is registered with this cubelet_url"),
    _c("request.invalid_idempotency_key", 422, "api", "Idempotency-Key header empty, over 200 chars or unprintable"),
    _c("request.memory_mismatch", 422, "api", "memory_mib differs from the template's guest memory (never replaced)"),
    _c("request.ambiguous_accelerators", 422, "api", "both the gpu shorthand and accelerators given"),
    _c("request.class_mismatch", 422, "api", "the requested class differs from the template's"),
    _c("request.invalid_accelerator", 422, "api", "an accelerator choice of the wrong shape"),
    _c("request.invalid_alternatives", 422, "api", "accelerator alternatives empty or too many"),
    _c("request.invalid_count", 422, "api", "accelerator count out of range"),
    _c("request.invalid_model", 422, "api", "accelerator model is not a model name"),
    _c("request.invalid_shorthand", 422, "api", "the gpu shorthand (`h100:2`) does not parse"),
    _c("request.multiple_accelerator_kinds", 422, "api", "alternatives mix accelerator classes"),
    _c("request.no_accelerator", 422, "api", "neither the template nor the request asks for an accelerator"),
    _c("request.unknown_class", 422, "api", "accelerator class is not gpu or accelerator"),
    _c("sandbox.busy", 409, "api", "the sandbox is being placed; retry"),
    _c("sandbox.conflict", 409, "api", "the sandbox id exists with different parameters"),
    _c("sandbox.create_in_progress", 409, "api", "a create with this id or key is still placing after the wait; retry"),
    _c("sandbox.id_outside_namespace", 422, "api", "a tenant's chosen sandbox id must start with its own prefix"),
    _c("sandbox.invalid_id", 422, "api", "sandbox id is not 1-64 of letters, digits and `_.-`"),
    _c("sandbox.reserved_id", 422, "api", "a create named an id in the nodes' own warm-* namespace"),
    _c("sandbox.lost", None, "cubelet", "sandbox error: its node's Cubelet no longer knows it"),
    _c("sandbox.not_found", 404, "api", "no sandbox with this id"),
    _c("sandbox.not_on_node", 409, "api", "the sandbox is not placed on the node named"),
    _c("sandbox.placement_abandoned", None, "scheduler", "sandbox error: its placement never finished"),
    _c("sandbox.start_failed", None, "cubelet", "sandbox error: the reservation closed during start with no failure"),
    _c("schedule.placement_failed", 409, "scheduler", "every candidate node refused the reservation"),
    _c("schedule.unschedulable", 409, "scheduler", "no node can host this sandbox; details per node and choice"),
    _c(
        "schedule.capacity_returning",
        503,
        "scheduler",
        "the devices that fit are being released or scrubbed and were not back within the create's wait; retry",
    ),
    _c("schedule.too_many_devices", 409, "scheduler", "every node's per-sandbox device limit is below the count asked"),
    _c("selector.compile_error", 422, "api", "the node selector does not compile"),
    _c("selector.invalid", 422, "api", "the node selector is not a string or is too long"),
    _c("selector.not_boolean", 422, "api", "the node selector does not evaluate to a boolean"),
    _c("up.qemu_missing", None, "backend", "`cubeaccel up --backend emulated` without qemu-system-x86_64"),
    _c("up.unknown_backend", None, "api", "`cubeaccel up` with a backend that does not exist"),
    _c("sandbox.lifetime_expired", None, "cubelet", "the Cubelet tore a sandbox down at the end of its lifetime"),
    # ---- identities, quotas (docs/security.md) ----
    _c("auth.missing_credential", 401, "api", "the route needs a credential (`Authorization: Bearer`); none sent"),
    _c("auth.invalid_credential", 401, "api", "the credential is unknown, malformed or revoked"),
    _c("auth.forbidden", 403, "api", "the credential's role may not call this route, or act for that tenant"),
    _c("auth.wrong_node", 403, "api", "a node's credential used for another node's route"),
    _c("auth.throttled", 429, "api", "too many failed authentications with this credential recently; retry later"),
    _c("auth.peer_not_allowed", 403, "api", "a uid other than root or the Cubelet's own used its unix socket"),
    _c("auth.no_policy", 500, "api", "a route without an access rule (a defect; refused, fail closed)"),
    _c("tenant.not_found", 404, "api", "no live tenant with this name"),
    _c("tenant.exists", 409, "api", "a tenant with this name exists"),
    _c("tenant.invalid_name", 422, "api", "tenant names are [A-Za-z0-9._-], 1-63 characters"),
    _c("key.not_found", 404, "api", "no live API key with this id"),
    _c("node.invalid_name", 422, "api", "node names are [A-Za-z0-9._-], 1-63 characters"),
    _c("quota.sandboxes", 429, "scheduler", "the tenant holds its quota of concurrent sandboxes"),
    _c("quota.accelerators", 429, "scheduler", "the create would take the tenant over its accelerators of this class"),
    _c("quota.pinned_memory", 429, "scheduler", "the create would take the tenant over its pinned guest memory"),
    _c("quota.lifetime", 422, "scheduler", "the requested lifetime (timeout_s) is over the tenant's maximum"),
    # ---- service mode and the CLI (docs/config.md) ----
    _c("cli.unreachable", None, "api", "the CLI could not reach CubeMaster or the Cubelet (the URL or socket named)"),
    _c("state.locked", 409, "api", "another process holds this state directory's lock (its pid is named)"),
    _c("config.invalid", None, "api", "the TOML config file does not parse or names an unknown setting"),
    _c("backup.failed", None, "api", "a backup or restore could not be written or read"),
    _c("template.pin_failed", None, "template", "`template pin`: the file has no guest section to rewrite"),
    # ---- image builder (CLI) ----
    _c("image.agent_missing", None, "template", "image build: no cube-agent sources to copy"),
    _c("image.apt_failed", None, "guest_kernel", "image build: apt-get download failed"),
    _c("image.busybox_missing", None, "template", "image build: busybox-static gave no /bin/busybox"),
    _c("image.download_failed", None, "guest_kernel", "image build: a package download failed"),
    _c("image.flavour_unknown", 422, "template", "image build: no such image flavour"),
    _c("image.kernel_format", None, "guest_kernel", "image build: the kernel image is not a bzImage"),
    _c("image.kernel_not_found", None, "guest_kernel", "image build: no kernel package for the release"),
    _c("image.import_mismatch", 422, "template", "image import: artifacts or versions differ from what is pinned"),
    _c("image.manifest_invalid", None, "template", "an image manifest that does not parse"),
    _c("image.module_missing", None, "modules_img", "image build: a required module is not in the kernel package"),
    _c("image.module_vermagic", None, "modules_img", "image build: a module's vermagic is not the kernel's"),
    _c("image.package_unavailable", None, "guest_kernel", "image build: a package is not in the archive"),
    _c("image.python_broken", None, "template", "image build: the guest python cannot import the agent"),
    _c("image.tool_missing", None, "guest_kernel", "image build: a host tool (apt-get, dpkg-deb) is missing"),
    _c("image.userland_incomplete", None, "template", "image build: a userland file or shared library is missing"),
    _c("image.vendor_build_failed", None, "modules_img", "image build: the vendor's kernel modules did not compile"),
    _c("image.vendor_file_missing", None, "userspace_driver", "image build: a vendor library or binary is missing"),
    _c("image.vendor_unknown", 422, "template", "image build: no such vendor driver stack"),
)
# fmt: on

CATALOG: dict[str, CodeInfo] = {c.code: c for c in CODES}


Observer = Callable[[str], None]
_observer: Observer | None = None


def set_observer(fn: Observer | None) -> Observer | None:
    """Install the guard that `check` reports problems to (tests install a recorder); returns the previous one.

    Off by default: in production an unknown code still reaches the user rather than failing the request.
    """
    global _observer
    previous, _observer = _observer, fn
    return previous


def problem(code: str, status: int | None = None) -> str | None:
    """Why `code` (carried with `status`) is not what the catalog says, or None when it is."""
    info = CATALOG.get(code)
    if info is None:
        return f"error code {code!r} is not in cubeaccel.protocol.error_catalog"
    if status is not None and info.status is not None and status != info.status:
        return f"error code {code!r} carries HTTP {status}, the catalog says {info.status}"
    return None


def check(code: str, status: int | None = None) -> None:
    if _observer is not None:
        why = problem(code, status)
        if why is not None:
            _observer(why)


def default_status(code: str, fallback: int = 400) -> int:
    info = CATALOG.get(code)
    return info.status if info is not None and info.status is not None else fallback


def http_status(code: str, carried: int) -> int:
    """The status a reply with this error code gets: the catalog's, or the carried one where it varies."""
    info = CATALOG.get(code)
    return info.status if info is not None and info.status is not None else carried


def markdown() -> str:
    """The table in docs/api.md, between its BEGIN/END markers."""
    rows = ["| code | HTTP | layer | meaning |", "|---|---|---|---|"]
    for c in sorted(CODES, key=lambda c: c.code):
        status = str(c.status) if c.status is not None else "—"
        rows.append(f"| `{c.code}` | {status} | {c.layer} | {c.meaning.replace('|', '/')} |")
    return "\n".join(rows) + "\n"


def main(argv: list[str]) -> int:
    if argv != ["--markdown"]:
        sys.stderr.write("usage: python -m cubeaccel.protocol.error_catalog --markdown\n")
        return 2
    sys.stdout.write(markdown())
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
