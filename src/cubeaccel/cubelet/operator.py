"""Operator verbs: explicit and audited (who, why, when). Never a shortcut around revalidation."""

from __future__ import annotations

from typing import Any

from cubeaccel.cubelet.ports import OperatorHost
from cubeaccel.cubelet.release import SCRUB_PENDING
from cubeaccel.cubelet.scrub import ScrubPolicy, scrub_method_name, scrub_needs_vm
from cubeaccel.model.device import DeviceRecord
from cubeaccel.model.event_kinds import EventKind
from cubeaccel.model.sanitize import leftover_tenant
from cubeaccel.model.states import TENANT_STATES, Actor, DeviceEvent, DeviceState
from cubeaccel.protocol.errors import conflict, invalid, not_found


def _audit(who: str, why: str) -> dict[str, str]:
    if not who.strip() or not why.strip():
        raise invalid("operator.audit_required", "operator verbs need a non-empty 'who' and 'reason'")
    if len(who) > 200 or len(why) > 2000:
        raise invalid("operator.audit_too_long", "'who' ≤ 200 and 'reason' ≤ 2000 characters")
    return {"who": who, "why": why}


def _device(cubelet: OperatorHost, device_id: str) -> DeviceRecord:
    d = cubelet.store.device(device_id)
    if d is None:
        raise not_found("device.not_found", f"no device {device_id!r}")
    return d


def quarantine(cubelet: OperatorHost, device_id: str, who: str, why: str) -> DeviceRecord:
    audit = _audit(who, why)
    with cubelet.change() as t:
        d = _device(cubelet, device_id)
        return t.transition(d, DeviceEvent.QUARANTINE, Actor.OPERATOR, reason="operator.quarantine", details=audit)


def recover(cubelet: OperatorHost, device_id: str, who: str, why: str) -> DeviceRecord:
    """Back to `allocatable` only if Cubelet's own revalidation passes now — and only once its last tenant's
    leftovers are proven gone. The operator vouches for the hardware, not for what a tenant left in its memory:
    where a scrub is still owed (policy `trusted-vm`, a method that needs a VM, no sanitizing stage since the last
    assignment in the journal), the device goes to `released` and the release path's scrub and revalidation run."""
    audit = _audit(who, why)
    rec = _recover(cubelet, device_id, audit)
    if rec.state is DeviceState.RELEASED:
        with cubelet.device_locks.hold(rec.id):
            cubelet.advance_scrub(rec.id)
        return _device(cubelet, device_id)
    return rec


def _scrub_still_owed(cubelet: OperatorHost, d: DeviceRecord) -> dict[str, Any]:
    """Why a recover does or does not owe the scrub (recorded in the transition's details)."""
    policy = cubelet.scrub_policy(d)
    tenant = leftover_tenant(e.to_json() for e in cubelet.store.events(device_id=d.id, limit=1_000_000))
    owed = policy is ScrubPolicy.TRUSTED_VM and scrub_needs_vm(d) and tenant is not None
    return {"scrub_owed": owed, "scrub_policy": policy.value, "scrub_method": scrub_method_name(d), "tenant": tenant}


def _recover(cubelet: OperatorHost, device_id: str, audit: dict[str, str]) -> DeviceRecord:
    with cubelet.lock:
        d = _device(cubelet, device_id)
        if d.state not in (DeviceState.QUARANTINED, DeviceState.UNHEALTHY):
            raise conflict(
                "operator.not_recoverable", f"device {device_id} is {d.state.value}", details={"state": d.state.value}
            )
        _refuse_while_vmm_may_live(cubelet, d)
        aer = cubelet.capabilities.aer
        accepted = aer.accept_aer(d.address) if aer is not None else None  # the operator acknowledges seen errors
        problems = cubelet.backend.validate(d)
        if problems:
            raise conflict(
                "recover.validation_failed",
                f"revalidation of {device_id} failed: {problems[0].message}",
                layer="host_hardware",
                details={"problems": [p.__dict__ for p in problems]},
            )
        scrub = _scrub_still_owed(cubelet, d)
        with cubelet.store.tx() as t:
            if accepted is not None:
                t.set_aer_baseline(d.id, accepted)
            if scrub["scrub_owed"]:  # the scrub clears the tenant's leftovers; its sandbox id stays for the audit
                return t.transition(
                    d,
                    DeviceEvent.RECOVER_SCRUB,
                    Actor.OPERATOR,
                    reason=SCRUB_PENDING,
                    details={**audit, **scrub, "aer_fatal_accepted": accepted},
                )
            return t.transition(
                d,
                DeviceEvent.RECOVER,
                Actor.OPERATOR,
                reason=None,
                sandbox_id=None,
                details={**audit, **scrub, "aer_fatal_accepted": accepted},
            )


def _refuse_while_vmm_may_live(cubelet: OperatorHost, d: DeviceRecord) -> None:
    """The release rules bind operators too: a device whose last VMM is not proven gone stays out, whatever
    the revalidation sees (after device_del no holder is visible, yet the VMM may still map its memory)."""
    res = cubelet.store.reservation(d.sandbox_id) if d.sandbox_id else None
    if res is None or d.id not in res.device_ids:
        return
    st = cubelet.vmm_status(res)
    if not cubelet.vmm_gone(res, st):
        raise conflict(
            "recover.vmm_alive",
            f"the VMM of sandbox {res.sandbox_id} that had {d.id} is not proven gone; it must exit first",
            layer="cubelet",
            details={"sandbox_id": res.sandbox_id, "vmm_pid": st.vmm_pid},
        )


def disable(cubelet: OperatorHost, device_id: str, who: str, why: str, restore_driver: bool = False) -> DeviceRecord:
    """A device a sandbox holds is not disabled under it: release the sandbox first.

    With `restore_driver`, the device goes back to the host driver it had before we bound vfio-pci.
    """
    audit = _audit(who, why)
    with cubelet.lock:
        with cubelet.store.tx() as t:
            d = _device(cubelet, device_id)
            if d.state in TENANT_STATES:
                raise conflict(
                    "device.in_use",
                    f"device {device_id} is {d.state.value} for sandbox {d.sandbox_id}",
                    details={"sandbox_id": d.sandbox_id},
                )
            d = t.transition(
                d,
                DeviceEvent.DISABLE,
                Actor.OPERATOR,
                reason="operator.disabled",
                details={**audit, "restore_driver": restore_driver},
            )
            original = t.original_driver(d.id)
        binding = cubelet.capabilities.binding
        if restore_driver and binding is not None:
            problems = binding.restore_host(d, original)
            with cubelet.store.tx() as t:
                t.event(
                    EventKind.DRIVER_RESTORED if not problems else EventKind.DRIVER_RESTORE_FAILED,
                    Actor.OPERATOR,
                    device_id=d.id,
                    reason=problems[0].code if problems else None,
                    details={**audit, "driver": original, "problems": [p.__dict__ for p in problems]},
                )
        return d


def enable(cubelet: OperatorHost, device_id: str, who: str, why: str) -> DeviceRecord:
    """disabled → initialized, then the normal validation decides allocatable or not."""
    from cubeaccel.cubelet.inventory import validate_initialized

    audit = _audit(who, why)
    with cubelet.change() as t:
        d = _device(cubelet, device_id)
        t.transition(d, DeviceEvent.ENABLE, Actor.OPERATOR, reason=None, sandbox_id=None, details=audit)
    validate_initialized(cubelet, cubelet.backend.discover())  # host I/O under the device's lock, not the node's
    return _device(cubelet, device_id)
