"""Which quarantines the node may retry by itself, and when: the one table of quarantine reasons.

A quarantine says the Cubelet could not prove a device safe. Some reasons are *transient*: what blocked the proof
can go away without anyone touching the device (a holder that exits, a scrub VM that did not boot this time).
Reconcile retries those with a backoff and a bound: each attempt probes the device again (no holder, the VMM
gone, the reset), is recorded (journal and audit log) with its result, and only a passing probe moves the device
on — back to `released` (event `retry`), never straight to `allocatable`, so the scrub (where owed) and the
revalidation run again. *Host-fact* reasons name something of the host the Cubelet checks on every pass (the
scrub image a device's scrub VM boots): retried as soon as that is back, not on a timer, within the same bound.
*Permanent* reasons (a scrub that ran and did not verify, a reset that failed, state that disagrees) wait for an
operator's `recover`. A reason not in the table is permanent: the operator decides.

Codes are those of protocol/error_catalog.py (tests check every code here is catalogued and every `quarantine:`
code of the catalog is classed here).
"""

from __future__ import annotations

from enum import StrEnum


class Recovery(StrEnum):
    TRANSIENT = "transient"  # reconcile retries it (bounded, with backoff)
    HOST_FACT = "host_fact"  # reconcile retries it once the host fact it names is back (bounded, no backoff)
    PERMANENT = "permanent"  # an operator's `recover`


T, H, P = Recovery.TRANSIENT, Recovery.HOST_FACT, Recovery.PERMANENT

QUARANTINE_REASONS: dict[str, Recovery] = {
    # what blocked the proof can go away by itself
    "release.holder_stuck": T,  # a process held the device's files past the release deadline
    "release.holder_unknown": T,  # a process whose fds could not be read (it may exit)
    "host.device_held": T,  # a process outside cubeaccel held the device
    "host.unexpected_holder": T,  # an unknown process opened the VFIO group
    "backend.vmm_still_running": T,  # (emulated) a VMM still listed the device
    "release.scrub_vm_not_started": T,  # the scrub VM did not boot or failed before scrubbing
    # what blocked it is a fact of the host the Cubelet checks on every pass: retried when that fact is back
    "release.scrub_image_unavailable": H,  # no usable scrub image: nothing was scrubbed; the image is built later
    # what only someone looking can settle
    "release.scrub_failed": P,  # the scrub ran and did not verify, or did not finish in time
    "release.vmm_not_exited": P,  # our VMM outlived SIGKILL
    "release.vmm_state_unknown": P,
    "release.device_node_not_returned": P,  # still openable by a VMM's uid
    "reconcile.no_reservation": P,  # the journal and the host disagree
    "reconcile.releasing_without_reservation": P,
    "reconcile.vmm_state_unknown": P,
    "operator.quarantine": P,  # an operator parked it: only an operator brings it back
    "backend.reset_failed": P,
    "backend.no_reset_method": P,
    "backend.reset_not_allowed": P,
}

RETRY_LIMIT = 5  # attempts per quarantine episode (until the device is allocatable again or an operator acts)
RETRY_BASE_S = 30.0  # the first attempt comes this long after the quarantine
RETRY_CAP_S = 15 * 60.0  # no wait between attempts is longer than this


def recovery_of(reason: str | None) -> Recovery:
    return QUARANTINE_REASONS.get(reason or "", Recovery.PERMANENT)


def retry_delay(attempt: int) -> float:
    """How long after the quarantine (attempt 1) or after the previous attempt (n > 1) attempt `attempt` may run:
    doubling from RETRY_BASE_S, capped at RETRY_CAP_S."""
    if attempt < 1:
        raise ValueError(f"attempts count from 1, got {attempt}")
    return min(RETRY_CAP_S, RETRY_BASE_S * 2.0 ** min(attempt - 1, 32))


def retry_due(reason: str | None, attempts: int, waited_s: float, host_fact_back: bool = False) -> bool:
    """Whether reconcile tries the device now: fewer than RETRY_LIMIT attempts so far in this episode, and either
    a transient reason with `waited_s` (since the quarantine, or since the last attempt) at least the next attempt's
    delay, or a host-fact reason whose fact is back (`host_fact_back`: nothing is gained by waiting longer, and
    nothing by trying before)."""
    recovery = recovery_of(reason)
    if recovery is Recovery.PERMANENT or attempts >= RETRY_LIMIT:
        return False
    if recovery is Recovery.HOST_FACT:
        return host_fact_back
    return waited_s >= retry_delay(attempts + 1)
