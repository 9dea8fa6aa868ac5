"""E2B's `update_network` body (SDK 2.63) → the running sandbox's effective policy, on a template's allowlist: E2B's
semantics (allow wins over deny, `allow_internet_access: false` is a deny of everything, what the update leaves
out is cleared, the template's allowlist is "all traffic"), and the options refused by name."""

from __future__ import annotations

import ipaddress
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cubeaccel.frontdoor import mapping as M
from cubeaccel.model.sandbox_policy import NetworkPolicy, narrow_network
from cubeaccel.protocol.errors import CubeError
from cubeaccel.wire.e2b_api import NetworkUpdate

TEMPLATE = NetworkPolicy.from_json(
    {"mode": "allowlist", "egress": ["10.0.0.0/16:443", "10.1.0.0/24:53/udp", "192.0.2.0/24:8080", "10.0.0.0/16:80"]}
)
NETS = sorted({r.network for r in TEMPLATE.egress})


@st.composite
def inside(draw: st.DrawFn) -> ipaddress.IPv4Address:
    """An address the template reaches."""
    net = draw(st.sampled_from(NETS))
    return net.network_address + draw(st.integers(0, net.num_addresses - 1))


@st.composite
def around(draw: st.DrawFn) -> str:
    """An E2B destination over template addresses: a bare IP or a CIDR (host bits set, as users write them)."""
    addr = draw(inside())
    prefix = draw(st.integers(14, 32))
    return str(addr) if prefix == 32 and draw(st.booleans()) else f"{addr}/{prefix}"


def _policy(body: dict[str, Any]) -> NetworkPolicy:
    return narrow_network(TEMPLATE, M.network_update(NetworkUpdate.model_validate(body)))


def _reaches(policy: NetworkPolicy, addr: ipaddress.IPv4Address, port: int, proto: str) -> bool:
    return any(addr in r.network and (r.port, r.proto) == (port, proto) for r in policy.egress)


@settings(max_examples=300, deadline=None)
@given(
    allow=st.lists(around(), max_size=3),
    deny=st.lists(st.one_of(around(), st.just(M.ALL_TRAFFIC)), max_size=3),
    internet=st.sampled_from([None, True, False]),
    probes=st.lists(inside(), min_size=1, max_size=8),
)
def test_allow_wins_over_deny_and_nothing_outside_the_template_is_ever_reached(
    allow: list[str], deny: list[str], internet: bool | None, probes: list[ipaddress.IPv4Address]
) -> None:
    body: dict[str, Any] = {}
    if allow:
        body["allowOut"] = allow
    if deny:
        body["denyOut"] = deny
    if internet is not None:
        body["allow_internet_access"] = internet
    try:
        policy = _policy(body)
    except CubeError as e:  # a cut into more rules than a namespace takes: refused, never clipped
        assert e.code == "network.policy_too_large"
        return
    allowed = [ipaddress.IPv4Network(a, strict=False) for a in allow]
    denied = [ipaddress.IPv4Network(d, strict=False) for d in deny] + (
        [ipaddress.IPv4Network(M.ALL_TRAFFIC)] if internet is False else []
    )
    for addr in probes:
        for rule in TEMPLATE.egress:
            if addr in rule.network:
                expected = any(addr in a for a in allowed) or not any(addr in d for d in denied)
                assert _reaches(policy, addr, rule.port, rule.proto) == expected, (addr, rule)
    assert all(any(t.covers(r) for t in TEMPLATE.egress) for r in policy.egress)


def test_an_update_that_names_nothing_clears_the_narrowing_to_the_templates_whole_allowlist() -> None:
    assert M.network_update(NetworkUpdate()) == {"allow_out": [], "deny_out": []}
    assert _policy({}) == TEMPLATE
    assert _policy({"allow_internet_access": True, "allowPublicTraffic": False}) == TEMPLATE
    assert _policy({"allow_internet_access": False}) == NetworkPolicy()  # no rule left: nothing reached


def test_what_changes_nothing_here_is_accepted() -> None:
    """A null proxy is E2B's "no proxy"; DNS servers matter only with a domain in allowOut (refused here)."""
    body: dict[str, Any] = {"egressProxy": None, "rules": {}, "dnsServers": ["1.1.1.1"], "allowPublicTraffic": True}
    assert _policy(body) == TEMPLATE


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ({"allowOut": ["api.example.com"]}, M.DESTINATION_UNSUPPORTED),
        ({"denyOut": ["2001:db8::/32"]}, M.DESTINATION_UNSUPPORTED),
        ({"egressProxy": {"address": "proxy.test:1080"}}, M.OPTION_UNSUPPORTED),
        ({"rules": {"api.example.com": [{"transform": {}}]}}, M.OPTION_UNSUPPORTED),
        ({"dnsServers": ["dns.example.com"]}, M.OPTION_UNSUPPORTED),
        ({"maskRequestHost": "${PORT}-x.example.com"}, M.OPTION_UNSUPPORTED),  # a create option, not an update's
        ({"allowOut": [7]}, M.DESTINATION_UNSUPPORTED),
    ],
)
def test_options_with_no_equivalent_are_refused_by_name(body: dict[str, Any], code: str) -> None:
    with pytest.raises(M.Refusal) as e:
        M.network_update(NetworkUpdate.model_validate(body))
    assert e.value.status == 400 and f"cubeaccel (api): {code}:" in e.value.message


def test_an_allow_the_template_reaches_nowhere_is_refused_not_silently_empty() -> None:
    with pytest.raises(CubeError) as e:
        _policy({"allowOut": ["203.0.113.9"], "denyOut": [M.ALL_TRAFFIC]})
    assert e.value.code == "network.policy_widened"
