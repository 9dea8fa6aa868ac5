"""E2B's `network` options through the real SDK, the front door, CubeMaster, a Cubelet and real MicroVMs.

The template allows two peers (tests/support/peer_net.py: a namespace beyond the node's uplink namespace, no route
further). One sandbox asks `allowOut=[peer]` with `denyOut=[all traffic]` and reaches that peer only; the other
asks `denyOut=[peer]` and reaches only the other one. Options cubeaccel cannot express are refused by name.
"""

from __future__ import annotations

import json
import shlex
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest
from e2b import Sandbox

from cubeaccel.frontdoor.mapping import ALL_TRAFFIC, DESTINATION_UNSUPPORTED, OPTION_UNSUPPORTED
from cubeaccel.images.manifest import Manifest
from tests.support.frontdoor_process import FrontDoorProcess
from tests.support.master_harness import MasterProcess, emulated_cubelet
from tests.support.peer_net import ALLOWED, OTHER, PORT, PROBE, peer_net
from tests.support.poll import poll
from tests.support.vmm_cleanup import kill_started_vmms
from tests.vm.test_master_ready import edu_template

pytestmark = [pytest.mark.vm, pytest.mark.timeout(900)]  # two cold boots under TCG on a shared host
NODE = "e2b-net-node"
TEMPLATE = "edu-e2b-net"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, guest_image: Manifest) -> Iterator[dict[str, Any]]:
    base = tmp_path_factory.mktemp("e2bnet")
    with peer_net() as net:
        master = MasterProcess(base / "master").start()
        (base / "cubelet").mkdir()
        cubelet = emulated_cubelet(master, base / "cubelet", NODE, "--network-uplink-netns", net.uplink)
        cubelet.start()
        fd = None
        started: list[str] = []
        try:
            poll(lambda: any(n.node == NODE and n.state == "ready" for n in master.client.nodes()), 30)
            tpl = edu_template(guest_image, TEMPLATE)
            tpl["spec"]["sandbox"] = {
                "network": {"mode": "allowlist", "egress": [f"{a}/32:{PORT}" for a in (ALLOWED, OTHER)]}
            }
            master.client.register_template(tpl)
            fd = FrontDoorProcess(base / "fd", master.url, master.admin_key, "--domain", "e2b.test").start()
            url = fd.url
            yield {
                "master": master,
                "started": started,
                "opts": {"api_key": master.tenant_key, "api_url": url, "sandbox_url": url, "request_timeout": 300},
            }
        finally:
            if fd is not None:
                fd.stop()
            cubelet.stop()
            master.stop()
            kill_started_vmms(base)
            for sid in started:  # only this run's sandboxes, by name
                subprocess.run(["ip", "netns", "del", f"cube-{sid}"], check=False, capture_output=True, timeout=30)


def create(stack: dict[str, Any], network: dict[str, Any]) -> Sandbox:
    sbx = Sandbox.create(TEMPLATE, network=network, timeout=600, **stack["opts"])  # type: ignore[arg-type]
    stack["started"].append(sbx.sandbox_id)
    return sbx


def probe(sbx: Sandbox, *targets: str) -> dict[str, str]:
    r = sbx.commands.run(f"python3 -c {shlex.quote(PROBE)} {' '.join(targets)}", timeout=120)
    return dict(json.loads(r.stdout))


def test_allow_out_reaches_only_that_peer_and_deny_out_blocks_it(stack: dict[str, Any]) -> None:
    only = create(stack, {"allow_out": [ALLOWED], "deny_out": [ALL_TRAFFIC]})
    denied = create(stack, {"deny_out": [ALLOWED]})
    try:
        targets = (f"{ALLOWED}:{PORT}", f"{OTHER}:{PORT}")
        got = probe(only, *targets)
        assert (
            got[targets[0]].startswith(f"hello {PORT} from {ALLOWED}") and got[targets[1]] == "ConnectionRefusedError"
        )
        got = probe(denied, *targets)
        assert got[targets[0]] == "ConnectionRefusedError" and got[targets[1]].startswith(f"hello {PORT} from {OTHER}")
        # what CubeMaster recorded and shows: the template's allowlist cut by the request
        shown = {s.sandbox_id: stack["master"].client.sandbox(s.sandbox_id).request for s in (only, denied)}
        assert shown[only.sandbox_id].network_policy == {"mode": "allowlist", "egress": [f"{ALLOWED}/32:{PORT}/tcp"]}
        assert shown[denied.sandbox_id].network_policy == {"mode": "allowlist", "egress": [f"{OTHER}/32:{PORT}/tcp"]}
    finally:
        only.kill()
        denied.kill()


@pytest.mark.parametrize(
    ("network", "code"),
    [
        ({"allow_out": ["api.example.com"], "deny_out": [ALL_TRAFFIC]}, DESTINATION_UNSUPPORTED),
        ({"egress_proxy": {"address": "proxy.test:1080"}}, OPTION_UNSUPPORTED),
        ({"allow_out": ["198.51.100.7"], "deny_out": [ALL_TRAFFIC]}, "network.policy_widened"),
    ],
)
def test_what_cannot_be_expressed_is_refused_by_name(stack: dict[str, Any], network: dict[str, Any], code: str) -> None:
    before = {s.id for s in stack["master"].client.sandboxes()}
    with pytest.raises(Exception) as e:
        create(stack, network)
    assert code in str(e.value)
    assert {s.id for s in stack["master"].client.sandboxes()} == before  # nothing was created


def test_update_network_changes_a_running_sandboxs_egress_in_place(stack: dict[str, Any]) -> None:
    """SDK 2.63's `update_network` on a running MicroVM: the new policy replaces the old whole (the peer it took
    away is refused, the one it gave is reached) with no restart, and CubeMaster shows it."""
    sbx = create(stack, {"allow_out": [ALLOWED], "deny_out": [ALL_TRAFFIC]})
    try:
        targets = (f"{ALLOWED}:{PORT}", f"{OTHER}:{PORT}")
        got = probe(sbx, *targets)
        assert (
            got[targets[0]].startswith(f"hello {PORT} from {ALLOWED}") and got[targets[1]] == "ConnectionRefusedError"
        )
        sbx.update_network({"deny_out": [ALLOWED]})
        got = probe(sbx, *targets)
        assert got[targets[0]] == "ConnectionRefusedError" and got[targets[1]].startswith(f"hello {PORT} from {OTHER}")
        shown = stack["master"].client.sandbox(sbx.sandbox_id)
        assert shown.request.network_policy == {"mode": "allowlist", "egress": [f"{OTHER}/32:{PORT}/tcp"]}
        assert shown.state == "running"
    finally:
        sbx.kill()
