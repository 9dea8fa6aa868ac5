"""What the Cubelet's journal records, by kind: one list, written by the Cubelet and read by its metrics, the
cold-start timeline, the device audit, the sanitize check, CubeMaster and the CLI.

Writers take an `EventKind`, so a kind nobody reads (a typo) is a type error. A journal row's kind stays a string
on reading: the journal keeps history, and a kind an older Cubelet wrote (and this one no longer writes) is
still shown, not refused.
"""

from __future__ import annotations

from enum import StrEnum


class EventKind(StrEnum):
    # devices
    DISCOVERED = "discovered"
    TRANSITION = "transition"  # a device state change; `event`, `from_state`, `to_state` say which
    QUARANTINE_RETRY = "quarantine_retry"
    DRIVER_RESTORED = "driver_restored"
    DRIVER_RESTORE_FAILED = "driver_restore_failed"
    SCRUB_STARTED = "scrub_started"
    SCRUB_FINISHED = "scrub_finished"
    # a sandbox's start
    RESERVATION_CREATED = "reservation_created"
    RESERVATION_EXPIRED = "reservation_expired"
    NETWORK_APPLIED = "network_applied"
    SHIM_REPORT = "shim_report"  # `event` is the report's kind
    SHIM_REPORT_REJECTED = "shim_report_rejected"
    GUEST_CHECKED = "guest_checked"
    STARTUP_FAILED = "startup_failed"
    SANDBOX_RUNNING = "sandbox_running"
    SANDBOX_WARM = "sandbox_warm"
    # a running sandbox's egress policy changed in place
    NETWORK_UPDATED = "network_updated"
    NETWORK_UPDATE_FAILED = "network_update_failed"  # the old ruleset stayed in force; the journal says so again
    # a sandbox's end
    LIFETIME_EXPIRED = "lifetime_expired"
    TEARDOWN_STARTED = "teardown_started"
    RELEASE_WAITING = "release_waiting"
    RELEASE_VMM_SURVIVES = "release_vmm_survives"
    SANDBOX_FILES_REMOVED = "sandbox_files_removed"
    NETWORK_REMOVED = "network_removed"
    NETWORK_TEARDOWN_FAILED = "network_teardown_failed"
    RESERVATION_CLOSED = "reservation_closed"
    # warm pools
    WARM_POOL_SET = "warm_pool_set"
    WARM_POOL_DROPPED = "warm_pool_dropped"
    WARM_RESET = "warm_reset"
    WARM_SETTINGS_UNREADABLE = "warm_settings_unreadable"
    WARM_START_FAILED = "warm_start_failed"
    WARM_DRAINED = "warm_drained"
    WARM_UNDRAINED = "warm_undrained"
    WARM_CLAIMED = "warm_claimed"
    DEVICE_CLAIMED = "device_claimed"  # one per device of a claimed warm sandbox: its custody passes to the claimer
    WARM_CLAIM_ACKED = "warm_claim_acked"
    # template snapshots (cubelet/snapshots.py)
    TEMPLATE_SNAPSHOT_QUEUED = "template_snapshot_queued"
    TEMPLATE_SNAPSHOT_READY = "template_snapshot_ready"
    TEMPLATE_SNAPSHOT_FAILED = "template_snapshot_failed"
    # the node
    HOST_READY = "host_ready"
    HOST_NOT_READY = "host_not_ready"
    SCRUB_IMAGE_READY = "scrub_image_ready"  # a stack's scrub image is here and intact again (`details.stack`)
    SCRUB_IMAGE_MISSING = "scrub_image_missing"  # its devices are held: `reason` says missing or mismatched
    QUARANTINE_RECLASSIFIED = "quarantine_reclassified"  # an older release's reason, read as the cause it recorded
    HOLDER_SCAN_EXEMPT = "holder_scan_exempt"
    MASTER_REACHABLE = "master_reachable"
    MASTER_UNREACHABLE = "master_unreachable"
    RECONCILE_REPAIR = "reconcile_repair"
    RECONCILE_FAILED = "reconcile_failed"
