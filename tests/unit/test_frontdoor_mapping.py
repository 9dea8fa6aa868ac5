"""The front door's pure parts: E2B create bodies, list filters and pages, error messages, envd routing helpers."""

from __future__ import annotations

import ipaddress
import json
import struct
import urllib.parse
from datetime import UTC, datetime
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cubeaccel.frontdoor import mapping as M
from cubeaccel.frontdoor.envd import host_sandbox, inject_envs
from cubeaccel.wire.e2b_api import NewSandbox
from cubeaccel.wire.master_api import Sandbox
from cubeaccel.workload import ENVD_VERSION


def test_the_reported_envd_version_is_the_guests() -> None:
    assert M.ENVD_VERSION == ENVD_VERSION


def test_create_body_maps_template_timeout_metadata_env_and_the_accelerators_key() -> None:
    req = NewSandbox.model_validate(
        {
            "templateID": "cuda12-h100",
            "timeout": 120,
            "metadata": {"a": "b", M.ACCELERATORS_KEY: " H100:2 "},
            "envVars": {"X": "1"},
            "secure": True,
            "mcp": None,
        }
    )
    body = M.create_body(req, "sb-1", "t" * 43)
    assert body.model_dump(exclude_unset=True) == {
        "id": "sb-1",
        "template": "cuda12-h100",
        "metadata": {"a": "b", M.ACCELERATORS_KEY: " H100:2 "},
        "env_vars": {"X": "1"},
        "workload_token": "t" * 43,
        "timeout_s": 120.0,
        "gpu": "H100:2",
    }
    alts = [{"class": "gpu", "count": 1, "selector": "device.model == 'H100'"}, {"class": "gpu", "count": 2}]
    req = NewSandbox.model_validate({"templateID": "x", "metadata": {M.ACCELERATORS_KEY: json.dumps(alts)}})
    assert M.create_body(req, "sb-2", "t" * 43).accelerators == alts
    with pytest.raises(M.Refusal) as e:
        M.create_body(NewSandbox.model_validate({"templateID": "x", "metadata": {M.ACCELERATORS_KEY: "[1,"}}), "s", "t")
    assert e.value.status == 400 and M.ACCELERATORS_KEY in e.value.message


@pytest.mark.parametrize(
    "field", [{"autoPause": True}, {"volumeMounts": [{"name": "v", "path": "/v"}]}, {"network": {"denyOut": ["x"]}}]
)
def test_features_we_do_not_have_are_refused_by_name(field: dict[str, object]) -> None:
    with pytest.raises(M.Refusal) as e:
        M.create_body(NewSandbox.model_validate({"templateID": "x", **field}), "s", "t")
    assert e.value.status == 400 and next(iter(field)) in e.value.message and not e.value.retry


def test_tokens_are_derived_per_sandbox_and_secret() -> None:
    a = M.envd_token(b"s1", "sb-a")
    assert a == M.envd_token(b"s1", "sb-a") and len(a) >= 32
    assert a != M.envd_token(b"s1", "sb-b") and a != M.envd_token(b"s2", "sb-a")
    assert set(a) <= set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")


@given(st.dictionaries(st.text(min_size=1, max_size=8), st.text(max_size=8), max_size=4))
def test_metadata_filters_round_trip_the_sdks_double_encoding(meta: dict[str, str]) -> None:
    quoted = {urllib.parse.quote(k): urllib.parse.quote(v) for k, v in meta.items()}  # what the SDK does
    assert M.parse_metadata_query(urllib.parse.urlencode(quoted)) == meta


def record(sid: str, state: str, created_at: float, metadata: dict[str, str]) -> Sandbox:
    """A sandbox as CubeMaster lists it, with the fields the front door reads."""
    return Sandbox.model_validate(
        {
            **dict.fromkeys(("node", "class", "count", "template", "error", "expires_at")),
            "id": sid,
            "tenant": "t",
            "state": state,
            "device_ids": [],
            "request": {"metadata": metadata},
            "timeline": [],
            "created_at": created_at,
            "updated_at": created_at,
        }
    )


def rows(n: int) -> list[Sandbox]:
    return [record(f"sb-{i}", "running", 100.0 + i, {"i": str(i % 2)}) for i in range(n)]


@given(st.integers(0, 30), st.integers(1, 7), st.booleans())
def test_pages_cover_every_row_once_in_order(n: int, limit: int, newest_first: bool) -> None:
    all_rows = M.select(rows(n), {}, {"running"}, newest_first=newest_first)
    seen, token = [], None
    for _ in range(n + 2):
        chunk, token = M.page(all_rows, limit, token, newest_first)
        seen += [r.id for r in chunk]
        if token is None:
            break
    order = [f"sb-{i}" for i in range(n)]
    assert seen == (order[::-1] if newest_first else order)


def test_lists_are_newest_first_by_default_and_filter_by_start_time() -> None:
    """E2B lists newest first; `order=asc` the other way; `startedAfter` keeps those started at or after it."""
    assert M.parse_order(None) is True and M.parse_order("desc") is True and M.parse_order("asc") is False
    with pytest.raises(M.Refusal):
        M.parse_order("sideways")
    assert [r.id for r in M.select(rows(3), {}, {"running"})] == ["sb-2", "sb-1", "sb-0"]
    after = M.parse_started_after(datetime.fromtimestamp(101.0, UTC).astimezone().isoformat())
    assert after == 101.0
    got = M.select(rows(3), {}, {"running"}, after, newest_first=False)
    assert [r.id for r in got] == ["sb-1", "sb-2"]
    with pytest.raises(M.Refusal):
        M.parse_started_after("yesterday")


def test_a_create_without_timeout_gets_e2bs_300_s() -> None:
    body = M.create_body(NewSandbox.model_validate({"templateID": "x"}), "sb-1", "t")
    assert body.timeout_s == 300.0


def test_select_filters_by_metadata_and_state() -> None:
    rs = [*rows(4), record("gone", "deleted", 1.0, {"i": "0"})]
    assert [r.id for r in M.select(rs, {"i": "0"}, {"running", "paused"})] == ["sb-2", "sb-0"]
    assert M.select(rs, {}, {"paused"}) == []
    with pytest.raises(M.Refusal):
        M.parse_states("running,sleeping")
    with pytest.raises(M.Refusal):
        M.page([], 1, "not-a-token")


def test_a_placement_refusal_names_the_layer_and_each_nodes_reason() -> None:
    err = {
        "code": "schedule.unschedulable",
        "layer": "scheduler",
        "message": "no node can host this sandbox — H100: 2 nodes, none free",
        "details": {
            "tried": [{"nodes": {"n1": {"reason": "no_capacity", "detail": "0 of 8 free"}, "n2": {"reason": "drain"}}}]
        },
    }
    r = M.refusal_from_master(409, {"error": err})
    assert r.status == 409 and not r.retry
    assert r.message.startswith("cubeaccel (scheduler): schedule.unschedulable: no node")
    assert "[nodes: n1: no_capacity (0 of 8 free); n2: drain]" in r.message
    assert M.refusal_from_master(422, {"error": {**err, "details": {}}}).status == 400
    assert M.refusal_from_master(502, "<html>").retry


def test_envd_hosts_and_start_envelopes() -> None:
    assert host_sandbox("49983-sb-abc.e2b.test", "e2b.test") == (49983, "sb-abc")
    assert host_sandbox("49983-sb-abc.e2b.test:8443", "e2b.test") == (49983, "sb-abc")
    assert host_sandbox("api.e2b.test", "e2b.test") is None
    assert host_sandbox("49983-sb-abc.other.test", "e2b.test") is None
    msg = json.dumps({"process": {"cmd": "/bin/bash", "envs": {"A": "mine"}}, "stdin": False}).encode()
    env = inject_envs(b"\x00" + struct.pack(">I", len(msg)) + msg, {"A": "sandbox", "B": "2"}, streaming=True)
    assert env[0] == 0 and struct.unpack(">I", env[1:5])[0] == len(env) - 5
    assert json.loads(env[5:])["process"]["envs"] == {"A": "mine", "B": "2"}  # the command's own wins
    assert json.loads(inject_envs(msg, {"B": "2"}, streaming=False))["process"]["envs"] == {"A": "mine", "B": "2"}
    compressed = b"\x01" + struct.pack(">I", 3) + b"abc"
    assert inject_envs(compressed, {"B": "2"}, streaming=True) == compressed  # not ours to judge: the guest does


def test_a_create_for_e2bs_default_template_where_none_is_registered_says_how_to_get_one() -> None:
    err = {"code": "template.unknown", "layer": "template", "message": "no template 'base'", "details": {}}
    r = M.refusal_from_error({**err, "details": {"template": "base"}}, 422)
    assert r.status == 400 and "examples/templates/base.yaml" in r.message
    assert "base.yaml" not in M.refusal_from_error({**err, "details": {"template": "other"}}, 422).message


# ---- E2B `network` → CubeMaster's address narrowing (issue 29 item 7) ----

_V4 = st.builds(lambda a, p: f"{a}/{p}", st.ip_addresses(v=4), st.integers(0, 32)) | st.ip_addresses(v=4).map(str)
_ENTRY = _V4 | st.sampled_from(["example.com", "*.e2b.dev", "::1", "2001:db8::/32", "10.0.0.256", "", "x/8"])
_NETWORK = st.fixed_dictionaries(
    {},
    optional={
        "allowOut": st.lists(_ENTRY, max_size=4),
        "denyOut": st.lists(_ENTRY, max_size=4) | st.just([M.ALL_TRAFFIC]),
        "allowPublicTraffic": st.booleans(),
        "egressProxy": st.none() | st.just({"address": "proxy.test:1080"}),
        "rules": st.none() | st.just({"api.test": [{"transform": {"headers": {"A": "b"}}}]}),
        "maskRequestHost": st.none() | st.just("${PORT}-x.test"),
        "tunnel": st.just(True),
    },
)


@given(_NETWORK, st.sampled_from([None, True, False]))
def test_every_e2b_network_option_is_either_a_narrowing_or_a_named_refusal(
    network: dict[str, Any], internet: bool | None
) -> None:
    from cubeaccel.model.sandbox_policy import AddressNarrowing, NetworkPolicy, narrow_network
    from cubeaccel.protocol.error_catalog import CATALOG

    req = NewSandbox.model_validate({"templateID": "x", "network": network, "allow_internet_access": internet})
    try:
        body = M.create_body(req, "s", "t")
    except M.Refusal as e:
        code = e.message.split(": ")[1]
        assert e.status == 400 and code in CATALOG and not e.retry, e.message
        assert code == M.OPTION_UNSUPPORTED or code == M.DESTINATION_UNSUPPORTED
        return
    asked = network.get("allowOut") or network.get("denyOut") or internet is False
    if not asked:
        assert "network" not in body.model_fields_set  # the template's policy
        return
    narrowing = body.network
    assert narrowing is not None and AddressNarrowing.asked(narrowing)
    parsed = AddressNarrowing.from_json(narrowing)  # what CubeMaster and the Cubelet read
    masked = {
        k: [ipaddress.IPv4Network(x, strict=False) for x in network.get(k) or []] for k in ("allowOut", "denyOut")
    }
    all_traffic = [ipaddress.IPv4Network(M.ALL_TRAFFIC)] if internet is False else []
    assert (list(parsed.allow_out), list(parsed.deny_out)) == (masked["allowOut"], masked["denyOut"] + all_traffic)
    template = NetworkPolicy.from_json({"mode": "allowlist", "egress": ["10.0.0.0/8:443"]})
    try:
        assert narrow_network(template, narrowing).mode in ("none", "allowlist")
    except Exception as e:
        assert getattr(e, "code", None) in ("network.policy_widened", "network.policy_too_large"), e


@pytest.mark.parametrize(
    ("network", "internet", "expected"),
    [
        ({"allowOut": ["192.0.2.10"], "denyOut": [M.ALL_TRAFFIC]}, True, (["192.0.2.10/32"], ["0.0.0.0/0"])),
        ({"denyOut": ["198.51.100.0/24"], "allowPublicTraffic": False}, None, ([], ["198.51.100.0/24"])),
        ({"allowOut": ["10.1.2.3/16"]}, False, (["10.1.0.0/16"], ["0.0.0.0/0"])),  # host bits masked, as E2B does
        ({"allowPublicTraffic": True}, True, None),  # the SDK's default body: the template's policy
    ],
)
def test_e2b_network_maps_to_allow_and_deny_out(
    network: dict[str, object], internet: bool | None, expected: tuple[list[str], list[str]] | None
) -> None:
    req = NewSandbox.model_validate({"templateID": "x", "network": network, "allow_internet_access": internet})
    got = M.create_body(req, "s", "t").network
    assert got == (None if expected is None else {"allow_out": expected[0], "deny_out": expected[1]})


@pytest.mark.parametrize(
    ("network", "code", "named"),
    [
        ({"allowOut": ["api.example.com"]}, M.DESTINATION_UNSUPPORTED, "api.example.com"),
        ({"denyOut": ["2001:db8::/32"]}, M.DESTINATION_UNSUPPORTED, "IPv6"),
        ({"egressProxy": {"address": "p.test:1080"}}, M.OPTION_UNSUPPORTED, "egressProxy"),
        ({"rules": {"a.test": []}, "allowOut": ["a.test"]}, M.OPTION_UNSUPPORTED, "rules"),
        ({"maskRequestHost": "${PORT}-x.test"}, M.OPTION_UNSUPPORTED, "maskRequestHost"),
        ({"somethingNew": 1}, M.OPTION_UNSUPPORTED, "somethingNew"),
    ],
)
def test_e2b_network_options_that_cannot_be_expressed_are_refused_by_name(
    network: dict[str, object], code: str, named: str
) -> None:
    with pytest.raises(M.Refusal) as e:
        M.create_body(NewSandbox.model_validate({"templateID": "x", "network": network}), "s", "t")
    assert e.value.status == 400 and f": {code}: " in e.value.message and named in e.value.message
