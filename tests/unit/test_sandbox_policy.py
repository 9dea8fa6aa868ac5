"""Sandbox policy in the template contract: network allowlists narrowed never widened, files, refused cases."""

from __future__ import annotations

import copy
import ipaddress
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cubeaccel.model.contract import check_template, template_digest
from cubeaccel.model.sandbox_policy import (
    EgressRule,
    FilesystemPolicy,
    NetworkPolicy,
    ReadonlyMount,
    mount_not_allowlisted,
    narrow_network,
)
from cubeaccel.protocol.errors import CubeError
from cubeaccel.wire.templates import load_document, load_template, parse_template

EXAMPLES = Path(__file__).resolve().parents[2] / "src" / "cubeaccel" / "examples" / "templates"


def doc(sandbox: dict[str, Any] | None) -> dict[str, Any]:
    d = copy.deepcopy(load_document(EXAMPLES / "edu-demo.yaml"))
    assert isinstance(d, dict)
    if sandbox is not None:
        d["spec"]["sandbox"] = sandbox
    return d


def codes(sandbox: dict[str, Any]) -> list[str]:
    return [v.code for v in check_template(parse_template(doc(sandbox)))]


def test_templates_without_a_sandbox_section_keep_their_digest_and_get_the_closed_defaults() -> None:
    t = parse_template(doc(None))
    assert t.sandbox.network.mode == "none" and not t.sandbox.network.has_nic
    assert t.sandbox.filesystem == FilesystemPolicy()
    assert "sandbox" not in t.to_json()["spec"]
    # written-out defaults are the same template: same canonical document, same digest
    explicit = parse_template(doc({"network": {"mode": "none"}, "device_sharing": "exclusive", "privileged": False}))
    assert template_digest(explicit) == template_digest(t)


def test_the_untrusted_tool_example_is_valid_and_declares_gpu_allowlist_and_scratch() -> None:
    t = load_template(EXAMPLES / "untrusted-tool-h100.yaml")
    assert check_template(t) == []
    assert t.accel_class == "gpu"
    assert t.sandbox.network.has_nic and t.sandbox.network.egress
    assert t.sandbox.filesystem.scratch_mib is not None


@pytest.mark.parametrize(
    ("sandbox", "code"),
    [
        ({"nested_virtualization": True}, "compat.unsupported_nested_virtualization"),
        ({"privileged": True}, "compat.unsupported_privileged"),
        ({"host_namespaces": ["network"]}, "compat.unsupported_host_namespace"),
        ({"device_sharing": "mig"}, "compat.unsupported_device_sharing"),
        ({"device_sharing": "vgpu"}, "compat.unsupported_device_sharing"),
        ({"device_sharing": "time_slicing"}, "compat.unsupported_device_sharing"),
        ({"lifecycle": ["snapshot"]}, "compat.unsupported_gpu_snapshot"),
        ({"lifecycle": ["clone", "pause"]}, "compat.unsupported_gpu_snapshot"),
        (
            {"network": {"mode": "allowlist", "egress": ["169.254.169.254/32:80"]}},
            "compat.network_forbidden_destination",
        ),
        ({"network": {"mode": "allowlist", "egress": ["127.0.0.0/8:22"]}}, "compat.network_forbidden_destination"),
        ({"network": {"mode": "allowlist", "egress": ["0.0.0.0/0:443"]}}, "compat.network_forbidden_destination"),
        ({"filesystem": {"scratch_mib": 1}}, "compat.scratch_invalid_size"),
        ({"filesystem": {"readonly_mounts": [{"source": "/srv/m", "target": "/proc/x"}]}}, "compat.mount_invalid"),
        ({"filesystem": {"readonly_mounts": [{"source": "/srv/../etc", "target": "/m"}]}}, "compat.mount_invalid"),
    ],
)
def test_unsupported_and_unsafe_cases_are_refused_at_registration_with_their_code(
    sandbox: dict[str, Any], code: str
) -> None:
    assert codes(sandbox) == [code]


@pytest.mark.parametrize(
    ("network", "code"),
    [
        ({"mode": "allowlist", "egress": ["10.0.0.0/33:80"]}, "network.invalid_rule"),
        ({"mode": "allowlist", "egress": ["10.0.0.1/24:80"]}, "network.invalid_rule"),  # host bits set
        ({"mode": "allowlist", "egress": ["10.0.0.0/24:0"]}, "network.invalid_rule"),
        ({"mode": "allowlist", "egress": ["10.0.0.0/24:80/icmp"]}, "network.invalid_rule"),
        ({"mode": "allowlist", "egress": []}, "network.invalid_policy"),
        ({"mode": "none", "egress": ["10.0.0.0/24:80"]}, "network.invalid_policy"),
    ],
)
def test_malformed_network_policies_are_refused_with_a_code(network: dict[str, Any], code: str) -> None:
    with pytest.raises(CubeError) as e:
        parse_template(doc({"network": network}))
    assert e.value.code == code


def test_unknown_sandbox_fields_and_unknown_sharing_modes_are_schema_errors() -> None:
    for sandbox in ({"gpu_sharing": "mig"}, {"device_sharing": "spatial"}):
        with pytest.raises(CubeError) as e:
            parse_template(doc(sandbox))
        assert e.value.code in ("template.unknown_field", "template.invalid_field")


TEMPLATE = NetworkPolicy.from_json({"mode": "allowlist", "egress": ["10.0.0.0/16:443", "192.0.2.10/32:8080/udp"]})


def test_a_request_may_narrow_the_template_network_but_never_widen_it() -> None:
    assert narrow_network(TEMPLATE, None) == TEMPLATE
    narrowed = narrow_network(TEMPLATE, {"mode": "allowlist", "egress": ["10.0.3.0/24:443"]})
    assert [str(r) for r in narrowed.egress] == ["10.0.3.0/24:443/tcp"]
    assert narrow_network(TEMPLATE, {"mode": "none"}) == NetworkPolicy()
    for wider in (["10.0.0.0/8:443"], ["10.0.0.0/16:80"], ["192.0.2.10/32:8080/tcp"], ["198.51.100.0/24:443"]):
        with pytest.raises(CubeError) as e:
            narrow_network(TEMPLATE, {"mode": "allowlist", "egress": wider})
        assert e.value.code == "network.policy_widened"
    with pytest.raises(CubeError) as e:  # a template with no network: any NIC is wider
        narrow_network(NetworkPolicy(), {"mode": "allowlist", "egress": ["10.0.0.0/24:443"]})
    assert e.value.code == "network.policy_widened"


octet = st.integers(0, 255)


@given(
    st.tuples(octet, octet, octet, octet), st.integers(8, 32), st.integers(1, 65535), st.sampled_from(["tcp", "udp"])
)
def test_a_narrowed_policy_only_ever_allows_what_the_template_allows(
    addr: tuple[int, int, int, int], prefix: int, port: int, proto: str
) -> None:
    import ipaddress

    net = ipaddress.IPv4Network((".".join(map(str, addr)), prefix), strict=False)
    rule = f"{net}:{port}/{proto}"
    try:
        got = narrow_network(TEMPLATE, {"mode": "allowlist", "egress": [rule]})
    except CubeError as e:
        assert e.code == "network.policy_widened"
        assert not any(t.covers(EgressRule.parse(rule)) for t in TEMPLATE.egress)
        return
    assert all(any(t.covers(r) for t in TEMPLATE.egress) for r in got.egress)


def test_readonly_mounts_need_the_node_operator_allowlist() -> None:
    fs = FilesystemPolicy(readonly_mounts=(ReadonlyMount("/srv/models/llama", "/models"), ReadonlyMount("/etc", "/e")))
    assert mount_not_allowlisted(fs, ()) == ["/srv/models/llama", "/etc"]
    assert mount_not_allowlisted(fs, ("/srv/models",)) == ["/etc"]
    assert mount_not_allowlisted(fs, ("/srv/model",)) == ["/srv/models/llama", "/etc"]  # a prefix is no parent


# ---- narrowing by address alone (E2B's allowOut/denyOut, issue 29 item 7) ----

_CIDR = st.builds(
    lambda a, p: ipaddress.IPv4Network(f"{a}/{p}", strict=False), st.ip_addresses(v=4), st.integers(8, 32)
)
_INSIDE = st.sampled_from(["10.0.0.0/8", "10.1.0.0/16", "10.1.2.0/24", "10.1.2.3/32", "192.0.2.0/28", "0.0.0.0/0"])
TEMPLATE_NET = NetworkPolicy.from_json(
    {"mode": "allowlist", "egress": ["10.0.0.0/8:443", "192.0.2.0/28:8080/udp", "10.1.2.0/24:8080/udp"]}
)


def _reaches(policy: NetworkPolicy, addr: ipaddress.IPv4Address, port: int, proto: str) -> bool:
    return any(addr in r.network and (r.port, r.proto) == (port, proto) for r in policy.egress)


@given(
    st.lists(_CIDR | _INSIDE.map(ipaddress.IPv4Network), max_size=3),
    st.lists(_CIDR | _INSIDE.map(ipaddress.IPv4Network), max_size=3),
    st.lists(st.ip_addresses(v=4), max_size=6),
)
def test_address_narrowing_keeps_exactly_the_template_minus_deny_plus_allow(
    allow: list[ipaddress.IPv4Network], deny: list[ipaddress.IPv4Network], probes: list[ipaddress.IPv4Address]
) -> None:
    asked = {"allow_out": [str(n) for n in allow], "deny_out": [str(n) for n in deny]}
    try:
        got = narrow_network(TEMPLATE_NET, asked)
    except CubeError as e:
        if e.code == "network.policy_widened":  # an allow_out entry the template reaches nowhere
            assert any(not any(a.overlaps(t.network) for t in TEMPLATE_NET.egress) for a in allow)
        else:
            assert e.code == "network.policy_too_large" and e.details["rules"] > 64
        return
    # addresses at every edge that matters: each named network's first and last, and random ones
    edges = [n[i] for n in (*allow, *deny, *(r.network for r in TEMPLATE_NET.egress)) for i in (0, -1)]
    for addr in [*edges, *probes]:
        for port, proto in ((443, "tcp"), (8080, "udp"), (22, "tcp")):
            want = _reaches(TEMPLATE_NET, addr, port, proto) and (
                not any(addr in d for d in deny) or any(addr in a for a in allow)
            )
            assert _reaches(got, addr, port, proto) == want, (addr, port, proto, got.to_json())
    assert got.has_nic == bool(got.egress)
    assert NetworkPolicy.from_json(got.to_json()) == got  # the Cubelet reads the recorded policy back


def test_address_narrowing_refuses_what_it_cannot_grant_and_other_keys() -> None:
    with pytest.raises(CubeError) as e:
        narrow_network(TEMPLATE_NET, {"allow_out": ["172.16.0.1"], "deny_out": ["0.0.0.0/0"]})
    assert e.value.code == "network.policy_widened" and e.value.details["widened"] == ["172.16.0.1/32"]
    with pytest.raises(CubeError) as e:
        narrow_network(TEMPLATE_NET, {"allow_out": [], "egress": ["10.0.0.0/8:443"]})
    assert e.value.code == "network.invalid_policy"
    with pytest.raises(CubeError) as e:
        narrow_network(TEMPLATE_NET, {"deny_out": ["example.com"]})
    assert e.value.code == "network.invalid_rule"
    assert narrow_network(TEMPLATE_NET, {"deny_out": ["0.0.0.0/0"]}) == NetworkPolicy()  # no NIC at all
