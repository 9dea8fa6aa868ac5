"""CubeMaster's sandbox and node machines, as data beside the device table.

A sandbox record is born `scheduling` (the row insert; a refused create deletes the row again, which is not a
transition either). CubeMaster's store applies each change as a compare-and-swap whose guard is the set of
states the table lets that actor fire the event from, so a caller can narrow the guard but never widen it.
The values are the strings stored in `sandboxes.state` / `nodes.state` and served by the API.
"""

from __future__ import annotations

from enum import StrEnum

from cubeaccel.model.machine import Machine, rule
from cubeaccel.model.states import Actor


class SandboxState(StrEnum):
    SCHEDULING = "scheduling"  # recorded, no node claimed (yet, or again after a refusal)
    PLACING = "placing"  # devices claimed on one node under its row lock; the Cubelet is being asked
    STARTING = "starting"  # the Cubelet reserved and is starting it
    RUNNING = "running"  # the Cubelet says every device is attached and the guest validated
    DELETING = "deleting"  # release asked of the Cubelet; not yet confirmed
    DELETED = "deleted"
    FAILED = "failed"  # with the Cubelet's code and layer in `error`
    LOST = "lost"  # the node holds no reservation for it and no record of its end


class SandboxEvent(StrEnum):
    CLAIM = "claim"
    REFUSED = "refused"  # the Cubelet refused or was unreachable: the claim is given back
    STARTED = "started"
    READY = "ready"
    FAIL = "fail"
    LOSE = "lose"
    DELETE = "delete"  # a user's delete
    TIMEOUT = "timeout"  # the sandbox's own timeout_s passed
    REVOKED = "revoked"  # its tenant was revoked: what the tenant's credential reached ends with it
    DELETED = "deleted"  # the Cubelet confirmed the release (or holds nothing)


class SandboxActor(StrEnum):
    USER = "user"  # the API: create, delete
    PLACEMENT = "placement"  # the create path of one replica, with the Cubelet's reply
    CUBELET = "cubelet"  # the node's word on its own sandbox: its status push, or the poll that replaces it
    MAINTENANCE = "maintenance"  # a replica's background work: reconcile, timeouts, abandoned creates, releases


SS, SE, SA = SandboxState, SandboxEvent, SandboxActor
USER, PLACEMENT, CUBELET, MAINT = SA.USER, SA.PLACEMENT, SA.CUBELET, SA.MAINTENANCE

SANDBOX_MACHINE: Machine[SandboxState, SandboxEvent, SandboxActor] = Machine(
    "sandbox",
    "api",
    (
        rule(SE.CLAIM, {SS.SCHEDULING}, SS.PLACING, {PLACEMENT}, "node row locked; its summary minus claims has room"),
        rule(SE.REFUSED, {SS.PLACING}, SS.SCHEDULING, {PLACEMENT}, "the next candidate may be tried"),
        rule(SE.STARTED, {SS.PLACING}, SS.STARTING, {PLACEMENT}, "the Cubelet reserved; the guest is not validated"),
        rule(SE.READY, {SS.PLACING}, SS.RUNNING, {PLACEMENT, MAINT}, "the Cubelet's reservation is running"),
        rule(SE.READY, {SS.STARTING}, SS.RUNNING, {CUBELET}, "the Cubelet says the guest validated"),
        rule(SE.FAIL, {SS.SCHEDULING}, SS.FAILED, {MAINT}, "the create placing it died"),
        rule(SE.FAIL, {SS.PLACING}, SS.FAILED, {PLACEMENT, CUBELET, MAINT}, "start failed, or the create died"),
        rule(SE.FAIL, {SS.STARTING, SS.RUNNING}, SS.FAILED, {CUBELET, MAINT}, "the Cubelet recorded a failure"),
        rule(SE.LOSE, {SS.STARTING, SS.RUNNING}, SS.LOST, {MAINT}, "the node holds neither it nor a record of its end"),
        rule(SE.DELETE, {SS.SCHEDULING, SS.PLACING}, SS.DELETING, {USER}, "its create is abandoned (stale row)"),
        rule(SE.DELETE, {SS.STARTING, SS.RUNNING, SS.DELETING}, SS.DELETING, {USER}, "-"),
        rule(SE.TIMEOUT, {SS.STARTING, SS.RUNNING}, SS.DELETING, {MAINT}, "expires_at passed"),
        rule(SE.REVOKED, {SS.STARTING, SS.RUNNING}, SS.DELETING, {USER, MAINT}, "its tenant was revoked"),
        rule(SE.DELETED, {SS.DELETING}, SS.DELETED, {USER, MAINT}, "the Cubelet released it or holds nothing"),
        rule(SE.DELETED, {SS.LOST, SS.FAILED}, SS.DELETED, {USER}, "nothing left to release"),
    ),
    ("sandbox.transition_refused", "sandbox.actor_not_allowed"),
)
SANDBOX_TRANSITIONS = SANDBOX_MACHINE.rules

# A create still owns the record in these states (delete is refused until the row is stale).
PLACEMENT_STATES: tuple[SandboxState, ...] = (SS.SCHEDULING, SS.PLACING)
# A node holds (or may hold) devices for the sandbox in these states.
HELD_STATES: tuple[SandboxState, ...] = (SS.STARTING, SS.RUNNING, SS.DELETING)
# Going or gone: the sandbox never runs again (E2B's "not found", envd's refusal).
ENDED_STATES: tuple[SandboxState, ...] = (SS.DELETING, SS.DELETED, SS.FAILED, SS.LOST)
# Where a wait for a start ends (a create's or show's `?wait=`): running, or ended.
SETTLED_STATES: tuple[SandboxState, ...] = (SS.RUNNING, *ENDED_STATES)
# Shown, never stored, for a live sandbox on a node whose heartbeats are stale (master/shown.py).
UNKNOWN_STATE = "unknown"


class NodeState(StrEnum):
    READY = "ready"  # schedulable while fresh and host-ready (staleness is derived, never stored)
    DRAINING = "draining"  # an operator's drain: no new placements, running sandboxes stay


class NodeEvent(StrEnum):
    DRAIN = "drain"
    UNDRAIN = "undrain"


N, NE = NodeState, NodeEvent

# A node is born `ready` by its first heartbeat. Both verbs are idempotent: draining a draining node is a no-op.
NODE_MACHINE: Machine[NodeState, NodeEvent, Actor] = Machine(
    "node",
    "api",
    (
        rule(NE.DRAIN, {N.READY, N.DRAINING}, N.DRAINING, {Actor.OPERATOR}, "-"),
        rule(NE.UNDRAIN, {N.READY, N.DRAINING}, N.READY, {Actor.OPERATOR}, "-"),
    ),
    ("node.transition_refused", "node.actor_not_allowed"),
)
NODE_TRANSITIONS = NODE_MACHINE.rules
