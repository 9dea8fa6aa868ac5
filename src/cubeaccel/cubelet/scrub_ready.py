"""The scrub image as host readiness, per device class: checked at host initialization and on every reconcile pass.

Under policy `trusted-vm` a device is cleared between tenants by a scrub VM booting the image the scrub registry
names for its kind (backends/scrub_methods.py: `image_stack`). A node that lacks it (never built, or built by the
release before an upgrade, or its files no longer match their pinned digests) could not clear the device after its
first tenant, so the device is held before anyone gets it: `initialized` with `host.scrub_image_missing` or
`host.scrub_image_mismatch` (an allocatable one goes back there), never bound or advertised, while the node's
other devices are served. The heartbeat and `GET /v1/host` list the problem; `cubeaccel host check` shows it too.
When a later pass finds the image, held devices are validated as usual, and a device a missing image already
quarantined at release (`release.scrub_image_unavailable`) is retried and scrubbed (model/recovery.py).

The last answer lives in the store's meta table (one read for the heartbeat and the API) and in memory for the
per-device checks of the pass; a change is one `scrub_image_missing` / `scrub_image_ready` event per stack.
"""

from __future__ import annotations

import json

from cubeaccel.backends.base import Problem
from cubeaccel.backends.scrub_methods import ScrubMethod, method_for
from cubeaccel.cubelet.ports import ScrubReadyHost
from cubeaccel.cubelet.scrub import IMAGE_UNAVAILABLE, SCRUB_FAILED, ScrubImageCheck, ScrubPolicy
from cubeaccel.cubelet.store import Tx
from cubeaccel.model.event_kinds import EventKind
from cubeaccel.model.states import Actor, DeviceEvent, DeviceState

META_KEY = "scrub_images"
# What an older release wrote when no image carried its agent: a failed scrub, though no scrub VM was started.
LEGACY_MISSING = "guest image carries this Cubelet's agent"


def needed(cubelet: ScrubReadyHost) -> dict[str, ScrubMethod]:
    """Image stack → a method booting it, for the node's devices whose policy is trusted-vm and whose method
    boots a VM."""
    out: dict[str, ScrubMethod] = {}
    for d in cubelet.store.devices():
        method = method_for(d.identity)
        if method is not None and method.needs_vm and cubelet.scrub_policy(d) is ScrubPolicy.TRUSTED_VM:
            out.setdefault(method.image_stack, method)
    return out


def current(t: Tx) -> tuple[Problem, ...]:
    """The last check's problems, one per stack whose image is not usable here (empty: none, or never checked)."""
    raw = t.meta(META_KEY)
    if raw is None:
        return ()
    return tuple(Problem(p["code"], p["message"], hard=False, held=True) for p in json.loads(raw).values())


def check(cubelet: ScrubReadyHost) -> dict[str, Problem]:
    """Ask the scrub runner about each stack the node needs; record the answer, hold what it cannot scrub. Writes
    only what changed: a pass whose answer is the last one's commits nothing."""
    runner = cubelet.scrub_runner
    problems: dict[str, Problem] = {}
    if isinstance(runner, ScrubImageCheck):
        for stack, method in sorted(needed(cubelet).items()):
            problem = runner.image_problem(method)
            if problem is not None:
                problems[stack] = problem
    cubelet.set_scrub_image_problems(problems)
    now = {stack: {"code": p.code, "message": p.message} for stack, p in problems.items()}
    with cubelet.store.read() as t:
        raw = t.meta(META_KEY)
    if (json.loads(raw) if raw is not None else {}) != now:
        _record(cubelet, now)
    _hold(cubelet)
    return problems


def _record(cubelet: ScrubReadyHost, now: dict[str, dict[str, str]]) -> None:
    with cubelet.change() as t:
        raw = t.meta(META_KEY)
        before: dict[str, dict[str, str]] = json.loads(raw) if raw is not None else {}
        t.set_meta(META_KEY, json.dumps(now))
        for stack in sorted(set(before) | set(now)):
            was, is_ = before.get(stack), now.get(stack)
            if was is not None and is_ is None:
                t.event(EventKind.SCRUB_IMAGE_READY, Actor.CUBELET, details={"stack": stack, "was": was})
            elif is_ is not None and (was is None or was["code"] != is_["code"]):
                details = {**is_, "stack": stack, "was": was}
                t.event(EventKind.SCRUB_IMAGE_MISSING, Actor.CUBELET, reason=is_["code"], details=details)


def _hold(cubelet: ScrubReadyHost) -> None:
    """Allocatable devices whose scrub image is gone go back to `initialized` with the reason now, not at the next
    release; `initialized` ones get it from their validation (inventory.py)."""
    if not cubelet.scrub_image_problems:
        return
    with cubelet.store.read() as t:
        held = [d for d in t.devices(DeviceState.ALLOCATABLE) if cubelet.scrub_refusal(d) is not None]
    if not held:
        return
    with cubelet.change() as t:
        for d in held:
            cur = t.device(d.id)
            refused = cubelet.scrub_refusal(d)
            if cur is None or refused is None or (cur.state, cur.generation) != (d.state, d.generation):
                continue  # reserved (or changed) meanwhile: its release meets the missing image instead
            details = {"problems": [refused.__dict__]}
            t.transition(cur, DeviceEvent.HOST_NOT_READY, Actor.CUBELET, reason=refused.code, details=details)


def reclassify_legacy(cubelet: ScrubReadyHost) -> list[str]:
    """Quarantines an older release recorded as `release.scrub_failed` although no scrub VM was started because no
    image carried its agent: read as what they were (`release.scrub_image_unavailable`), so they recover by
    themselves once the image is here. Recognised by the quarantine's own record: no shim ran (no `shim_rc`) and
    its message is the missing image's. Returns the device ids."""
    changed = []
    with cubelet.store.read() as t:
        quarantined = t.devices(DeviceState.QUARANTINED)
    for d in quarantined:
        if d.reason != SCRUB_FAILED:
            continue
        with cubelet.store.read() as t:
            row = t.c.execute(
                "SELECT details FROM events WHERE device_id=? AND kind=? AND event=? ORDER BY seq DESC LIMIT 1",
                (d.id, EventKind.TRANSITION.value, DeviceEvent.QUARANTINE.value),
            ).fetchone()
        cause = json.loads(row["details"]) if row is not None else None
        if not isinstance(cause, dict) or "shim_rc" in cause or LEGACY_MISSING not in str(cause.get("message", "")):
            continue
        with cubelet.change() as t:
            cur = t.device(d.id)
            if cur is None or (cur.state, cur.generation) != (d.state, d.generation):
                continue
            t.set_reason(cur, IMAGE_UNAVAILABLE)
            details = {"was": SCRUB_FAILED, "message": cause.get("message")}
            t.event(
                EventKind.QUARANTINE_RECLASSIFIED,
                Actor.CUBELET,
                device_id=d.id,
                reason=IMAGE_UNAVAILABLE,
                details=details,
            )
        changed.append(d.id)
    return changed
