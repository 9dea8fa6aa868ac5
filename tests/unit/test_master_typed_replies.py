"""What CubeMaster serves from its stored rows and the nodes' heartbeats, typed: a tenant's quota, a create's
accelerator request, a node's guest images and pinned-memory ledger. The JSON is what the dict replies gave, byte
for byte (the old construction is the oracle), and a malformed value is refused by name where it enters."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from cubeaccel.master import schema as S
from cubeaccel.master.auth import ADMIN
from cubeaccel.master.records import Quota
from cubeaccel.master.server import create_app
from cubeaccel.master.service import CubeMaster
from cubeaccel.master.store import MasterStore
from cubeaccel.master.view import view_from_heartbeat
from cubeaccel.model.request import AcceleratorChoice, AcceleratorRequest
from cubeaccel.protocol.errors import CubeError
from cubeaccel.wire import master_api as W
from tests.support.master_builders import EXAMPLE_IMAGES, group, heartbeat
from tests.support.stored_rows import normalized_requests

H100 = "H100-PCIe-80GB"
LEDGER_KEYS = (  # cubelet/memory_ledger.Ledger.to_json, in its order
    "lockable_mib",
    "locked_mib",
    "free_mib",
    "source",
    "per_vmm_limit_mib",
    "vmm_overhead_mib",
    "vmm_overhead_per_vcpu_mib",
    "sandboxes",
)
mib = st.integers(0, 2**40)
lifetime = st.none() | st.floats(0.001, 30 * 86400.0) | st.integers(1, 30 * 86400)
quotas = st.builds(
    Quota,
    st.none() | st.integers(0, 1000),
    st.dictionaries(st.sampled_from(["gpu", "accelerator", "none"]), st.integers(0, 64)),
    st.none() | mib,
    lifetime,
    lifetime,
)


def dumped(model: Any) -> str:
    return json.dumps(model.model_dump(mode="json", by_alias=True))  # as FastAPI and the CLI dump replies


# ---- a tenant's quota: the stored row as it was served ----


@settings(max_examples=80, deadline=None)
@given(quota=quotas, dropped=st.sets(st.sampled_from(list(Quota().to_json()))))
def test_a_quota_is_served_as_the_stored_row(quota: Quota, dropped: set[str]) -> None:
    row = {k: v for k, v in quota.to_json().items() if k not in dropped}  # a hand-edited or older row, too
    shown = W.QuotaShown.model_validate(json.loads(json.dumps(row)))
    assert dumped(shown) == json.dumps(row)
    assert shown.max_sandboxes == row.get("max_sandboxes") and shown.max_lifetime_s == row.get("max_lifetime_s")


def test_the_tenant_list_serves_each_quota_as_stored(tmp_path: Path) -> None:
    master = CubeMaster(MasterStore(str(tmp_path / "m.db")))
    try:
        _, admin = master.auth.create_key(ADMIN)
        api = TestClient(create_app(master))
        auth = {"Authorization": f"Bearer {admin}"}
        quota = {"max_sandboxes": 2, "max_accelerators": {"gpu": 4}, "max_lifetime_s": 3600}
        assert api.post("/v1/tenants", json={"name": "acme", "quota": quota}, headers=auth).status_code == 201
        master.auth.create_tenant("zed", Quota())
        with master.store.tx() as c:  # a row written before `default_lifetime_s` existed
            c.execute(sa.update(S.tenants).where(S.tenants.c.name == "zed").values(quota={"max_sandboxes": None}))
        text = api.get("/v1/tenants", headers=auth).text
        served = [t["quota"] for t in json.loads(text)["tenants"]]
        assert served == [Quota.from_json(quota).to_json(), {"max_sandboxes": None}]
        assert json.dumps(served[0]) == json.dumps(Quota(2, {"gpu": 4}, None, 3600.0, None).to_json())
        rows = master.auth.tenants()
        assert rows[0].quota.max_accelerators == {"gpu": 4} and rows[0].quota.max_lifetime_s == 3600.0
    finally:
        master.store.close()


# ---- a create's accelerator request: stored and served as `AcceleratorRequest.to_json` wrote it ----

choices = st.builds(
    AcceleratorChoice,
    st.sampled_from(["gpu", "accelerator", "none"]),
    st.integers(0, 64),
    st.none() | st.text(min_size=1, max_size=20),
    st.none() | st.from_regex(r"[A-Z][A-Za-z0-9-]{0,10}", fullmatch=True),
)


@settings(max_examples=100, deadline=None)
@given(first=choices, alternatives=st.lists(choices, max_size=3))
def test_an_accelerator_request_is_served_as_its_json(
    first: AcceleratorChoice, alternatives: list[AcceleratorChoice]
) -> None:
    old = AcceleratorRequest((first, *alternatives)).to_json()
    shown = W.AcceleratorShown.model_validate(old)
    assert dumped(shown) == json.dumps(old)
    assert json.dumps(shown.model_dump(mode="json")) == json.dumps(old)  # the store dumps without by_alias
    assert (shown.accel_class, shown.count, shown.selector, shown.model) == (
        first.accel_class,
        first.count,
        first.selector,
        first.model,
    )
    assert [a.accel_class for a in shown.alternatives] == [a.accel_class for a in alternatives]


@settings(max_examples=100, deadline=None)
@given(request=normalized_requests())
def test_a_stored_create_request_is_served_byte_for_byte(request: dict[str, Any]) -> None:
    shown = W.SandboxRequest.model_validate(request)
    assert dumped(shown) == json.dumps(request) == json.dumps(shown.model_dump(mode="json"))


def test_a_malformed_stored_accelerator_entry_is_refused_by_name() -> None:
    with pytest.raises(ValidationError) as e:
        W.SandboxRequest.model_validate({"accelerators": [{"class": "gpu", "count": "two"}]})
    assert [err["loc"] for err in e.value.errors()] == [("accelerators", 0, "count")]


# ---- a node's guest images and pinned-memory ledger, as the node list served them ----


def old_summary_fields(body: dict[str, Any], claimed_mib: int, free_after: int) -> dict[str, Any]:
    """What `NodeView.summary` put in these fields when they were dicts."""
    view = view_from_heartbeat(body, 1000.0)
    return {
        "pinned_memory": {
            **body.get("pinned_memory", {}),
            "claimed_mib": claimed_mib,
            "free_after_claims_mib": free_after,
        },
        "guest_images": [i.to_json() for i in view.guest_images],
    }


ledgers = st.fixed_dictionaries(
    {
        "lockable_mib": mib,
        "locked_mib": mib,
        "free_mib": mib,
        "source": st.sampled_from(["meminfo", "configured"]),
        "per_vmm_limit_mib": st.none() | mib,
        "vmm_overhead_mib": st.integers(0, 4096),
        "vmm_overhead_per_vcpu_mib": st.integers(0, 4096),
        "sandboxes": st.dictionaries(st.text(min_size=1, max_size=8), mib, max_size=3),
    }
)


@settings(max_examples=80, deadline=None)
@given(ledger=ledgers, kept=st.sets(st.sampled_from(LEDGER_KEYS)), empty=st.booleans())
def test_a_node_is_served_with_its_ledger_and_images_as_the_dict_reply_served_them(
    ledger: dict[str, Any], kept: set[str], empty: bool
) -> None:
    sent = {} if empty else {k: ledger[k] for k in LEDGER_KEYS if k in kept}  # an older Cubelet sent fewer
    body = heartbeat("n", group(H100, 2), pinnable=1 << 20, pinned=sent)
    view = view_from_heartbeat(body, 1000.0)
    shown = view.summary(1001.0, 10.0, W.NodeSummary)
    old = old_summary_fields(body, view.admitted_memory_mib, view.free_pinnable_mib())
    got = json.loads(dumped(shown))
    assert json.dumps(got["pinned_memory"]) == json.dumps(old["pinned_memory"])
    assert json.dumps(got["guest_images"]) == json.dumps(old["guest_images"]) == json.dumps(EXAMPLE_IMAGES)
    assert shown.pinned_memory.lockable_mib == sent.get("lockable_mib")
    assert shown.guest_images[0].kernel_release == EXAMPLE_IMAGES[0]["kernel_release"]


def test_a_newer_cubelets_ledger_field_passes_through() -> None:
    body = heartbeat("n", group(H100, 2), pinned={"lockable_mib": 10, "hugepages_mib": 4})
    view = view_from_heartbeat(body, 1000.0)
    got = json.loads(dumped(view.summary(1001.0, 10.0, W.NodeSummary)))["pinned_memory"]
    assert got == {"lockable_mib": 10, "hugepages_mib": 4, "claimed_mib": 0, "free_after_claims_mib": 1 << 20}


@pytest.mark.parametrize(
    ("ledger", "where"),
    [({"sandboxes": {"sb-1": "lots"}}, "sandboxes"), ({"source": 7}, "source"), ({"per_vmm_limit_mib": "x"}, "per")],
)
def test_a_malformed_ledger_is_refused_when_the_heartbeat_arrives(ledger: dict[str, Any], where: str) -> None:
    """The dict code stored it, and then served it as sent; now it is refused where it enters, by name."""
    with pytest.raises(CubeError) as e:
        view_from_heartbeat(heartbeat("n", group(H100, 1), pinned=ledger), 1000.0)
    assert e.value.code == "node.invalid_heartbeat" and where in e.value.message


def test_a_stored_entry_without_class_or_count_reads_with_the_parsers_defaults_and_stays_as_stored() -> None:
    row = {"accelerators": [{"alternatives": [{"class": "gpu", "count": 1}]}]}
    shown = W.SandboxRequest.model_validate(row)
    assert (shown.accelerators[0].accel_class, shown.accelerators[0].count) == ("gpu", 1)
    assert shown.model_dump(mode="json") == row and json.loads(dumped(shown)) == row
