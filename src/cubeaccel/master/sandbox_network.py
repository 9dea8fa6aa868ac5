"""A running sandbox's egress policy, changed in place (`PUT /v1/sandboxes/{id}/network`; E2B's
`update_network` through the front door).

The new narrowing replaces the create's whole, as E2B's update does (what it leaves out is cleared): it is
judged against the sandbox's frozen contract first (a widening or a cut into too many rules is a 4xx that asks
no node), then the node's Cubelet applies it (it derives the policy again, journals it and loads the namespace's
ruleset in one nft transaction: cubelet/network_update.py), and only then is it recorded on the sandbox: the
request's `network` and `network_policy`, and a `network_set` entry on the timeline. The API edge audits the call
(`sandbox:set_network`). A node that refuses or cannot be reached leaves the record as it was.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import httpx
from pydantic import ValidationError

from cubeaccel.master.records import SandboxRow
from cubeaccel.model.contract import CompatibilityContract
from cubeaccel.model.sandbox_policy import NetworkPolicy, narrow_network
from cubeaccel.model.sandbox_states import SandboxState
from cubeaccel.protocol.errors import CubeError
from cubeaccel.wire import master_api as W
from cubeaccel.wire.sandbox_timeline import NetworkSet

if TYPE_CHECKING:
    from cubeaccel.master.service import CubeMaster


def set_network(master: CubeMaster, sandbox_id: str, network: dict[str, Any]) -> SandboxRow:
    """The sandbox as recorded once its node has loaded the new policy."""
    row = master.get(sandbox_id)
    if row.state is not SandboxState.RUNNING:
        raise _not_running(row)
    template = CompatibilityContract.from_json(row.contract).template.sandbox.network if row.contract else None
    policy = narrow_network(template or NetworkPolicy(), network)
    url = master.node_url(row.node)
    if url is None:
        raise CubeError("cubelet.unreachable", f"sandbox {sandbox_id}'s node {row.node} is not known here", "api")
    try:
        master.client(url).set_network(sandbox_id, network)
    except (httpx.HTTPError, ValidationError) as e:
        raise CubeError("cubelet.unreachable", f"node {row.node}: {type(e).__name__}: {str(e)[:200]}", "api") from e
    request = row.request.model_dump(mode="json")
    request["network"] = network
    request.pop("network_policy", None)
    if policy.has_nic:
        request["network_policy"] = policy.to_json()
    egress = [str(r) for r in policy.egress]
    recorded = master.store.update_sandbox(
        sandbox_id,
        "network_set",
        expect=(SandboxState.RUNNING,),
        detail=NetworkSet(network=network, egress=egress),
        request=W.SandboxRequest.model_validate(request).model_dump(mode="json"),
    )
    if not recorded:  # ended while its node loaded the rules: the namespace goes with it
        raise _not_running(master.get(sandbox_id))
    return master.get(sandbox_id)


def _not_running(row: SandboxRow) -> CubeError:
    return CubeError(
        "network.not_running",
        f"sandbox {row.id} is {row.state.value}: only a running sandbox's network policy is changed",
        "api",
        {"state": row.state.value},
        409,
    )
