"""A running sandbox's egress policy, changed in place (`PUT /v1/reservations/{id}/network`: E2B's
`update_network`, through CubeMaster), and the reconcile pass's reload of every sandbox's ruleset.

The journal is the truth and the namespace follows it. A change is derived again here from the sandbox's frozen
template (as at reserve: `Cubelet.network_policy`, never trusted from CubeMaster), journaled (the reservation's
`params.network` and its checkpoint's `egress`, event `network_updated`), then loaded as one nft transaction
(host/net/netpolicy.apply): the old ruleset stays in force until the new one is whole. A load that fails leaves the
old ruleset, and the journal is set back to it (`network_update_failed`); a Cubelet that dies between the two
loads the journaled policy in its first reconcile pass (`reload`: nothing is known loaded after a restart).

A sandbox started without a NIC (its policy allowed nothing) cannot be given egress while it runs: the guest has
no interface to hot-add one to (`network.no_nic`). One that has a NIC keeps it when a change allows nothing: its
ruleset then rejects every packet from the guest.
"""

from __future__ import annotations

import dataclasses
from ipaddress import IPv4Address
from typing import Any

from cubeaccel.cubelet.ports import NetworkHost
from cubeaccel.cubelet.store import Reservation
from cubeaccel.host.net import netpolicy
from cubeaccel.model.event_kinds import EventKind
from cubeaccel.model.reservation_params import NetworkRequest
from cubeaccel.model.reservation_states import ReservationPhase
from cubeaccel.model.sandbox_policy import NetworkPolicy
from cubeaccel.model.states import Actor
from cubeaccel.protocol.errors import CubeError, conflict


def _lock_key(sandbox_id: str) -> str:
    return f"network:{sandbox_id}"


def recorded_policy(res: Reservation) -> NetworkPolicy:
    """The journaled policy (none recorded: nothing is allowed)."""
    return res.params.network or NetworkPolicy()


def set_network(cubelet: NetworkHost, sandbox_id: str, requested: NetworkRequest) -> Reservation:
    """The running sandbox's policy becomes its template's narrowed by `requested` (which replaces the create's
    narrowing whole: E2B's update clears what it leaves out). Journaled, then loaded; the reservation after."""
    with cubelet.device_locks.hold(_lock_key(sandbox_id)):
        res = cubelet.get_reservation(sandbox_id)
        _refuse_unless_running(res)
        policy = cubelet.network_policy(res.params.contract, requested)
        built = res.checkpoint.network
        if built is None and policy.has_nic and cubelet.shim.host_devices:  # a simulated node builds none
            raise conflict(
                "network.no_nic",
                f"sandbox {sandbox_id} was started without a network interface (its policy allowed nothing): "
                "egress cannot be added while it runs; create it with the destinations it needs",
                details={"egress": [str(r) for r in policy.egress]},
            )
        before = recorded_policy(res)
        _journal(
            cubelet,
            sandbox_id,
            policy,
            EventKind.NETWORK_UPDATED,
            {"requested": requested.to_json(), "egress": _rules(policy), "previous": _rules(before)},
        )
        if built is not None and cubelet.shim.host_devices:
            uplink = built.get("uplink_netns")
            try:
                loaded = netpolicy.Loaded(policy, frozenset(netpolicy.node_addresses(uplink)))
                netpolicy.apply(sandbox_id, loaded.policy, loaded.node)
            except CubeError as e:  # nft loads whole or not at all: the old ruleset is still the one in force
                _journal(
                    cubelet,
                    sandbox_id,
                    before,
                    EventKind.NETWORK_UPDATE_FAILED,
                    {"code": e.code, "message": e.message, "kept": _rules(before)},
                    check_running=False,
                )
                raise
            cubelet.loaded_networks[sandbox_id] = loaded
            cubelet.audit_host("network:update", sandbox_id, egress=_rules(policy), previous=_rules(before))
        return cubelet.get_reservation(sandbox_id)


def reload(cubelet: NetworkHost, sandbox_id: str, node: frozenset[IPv4Address]) -> None:
    """Load the sandbox's journaled policy with the node's addresses `node` as they are now, unless that is what
    its namespace already holds (the reconcile pass; after a restart nothing is known loaded)."""
    with cubelet.device_locks.hold(_lock_key(sandbox_id)):
        res = cubelet.store.reservation(sandbox_id)
        if res is None:
            return
        want = netpolicy.Loaded(recorded_policy(res), node)
        if cubelet.loaded_networks.get(sandbox_id) != want:
            netpolicy.apply(sandbox_id, want.policy, want.node)
            cubelet.loaded_networks[sandbox_id] = want


def _refuse_unless_running(res: Reservation) -> None:
    if res.phase is not ReservationPhase.RUNNING:
        raise conflict(
            "network.not_running",
            f"sandbox {res.sandbox_id} is {res.phase.value}: only a running sandbox's network policy is changed",
            layer="api",
            details={"phase": res.phase.value},
        )


def _rules(policy: NetworkPolicy) -> list[str]:
    return [str(r) for r in policy.egress]


def _journal(
    cubelet: NetworkHost,
    sandbox_id: str,
    policy: NetworkPolicy,
    kind: EventKind,
    details: dict[str, Any],
    check_running: bool = True,
) -> None:
    """Record `policy` as the sandbox's (params and checkpoint) with its event, in one transaction. A setting back
    (`check_running` False) of a reservation that closed meanwhile has nothing left to set."""
    with cubelet.change() as t:
        cur = t.reservation(sandbox_id)
        if cur is None and not check_running:
            return
        if cur is None:
            raise conflict("network.not_running", f"sandbox {sandbox_id} has no reservation any more", layer="api")
        if check_running:
            _refuse_unless_running(cur)
        cur.params = dataclasses.replace(cur.params, network=policy if policy.has_nic else None)
        if cur.checkpoint.network is not None:
            cur.checkpoint.network = {**cur.checkpoint.network, "egress": _rules(policy)}
        t.update_reservation_params(cur)
        t.event(kind, Actor.CUBELET, sandbox_id=sandbox_id, details=details)
