"""CPU-only templates (no accelerator, issue 29 item 4): the contract, the request, placement and the claim treat zero
devices as a case of their own — placed on memory and guest facts alone, charged to quotas as a sandbox and its
pinned memory, never as a device."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cubeaccel.master.auth import Auth
from cubeaccel.master.index import NodeIndex
from cubeaccel.master.records import Quota
from cubeaccel.master.scheduler import CPU_GROUP, Context, decide, evaluate_indexed, explain
from cubeaccel.master.store import MasterStore
from cubeaccel.master.view import NodeView
from cubeaccel.model.contract import CompatibilityContract, NodeSummary, check_guest, check_node, freeze
from cubeaccel.model.registration_checks import check_template
from cubeaccel.model.request import AcceleratorChoice, for_template
from cubeaccel.model.template_spec import NO_ACCELERATOR, Template
from cubeaccel.protocol.errors import CubeError
from cubeaccel.protocol.reports import GuestReport
from cubeaccel.wire.templates import parse_template
from tests.support.contract_builders import EXAMPLES, example_doc, set_path
from tests.support.master_builders import group, heartbeat, image, sandbox_row, view
from tests.support.scheduler_oracle import evaluate

BASE_FILE = EXAMPLES / "base.yaml"
NOW, STALE = 1001.0, 10.0
H100 = "H100-PCIe-80GB"
NO_DEVICES = AcceleratorChoice(NO_ACCELERATOR, 0)


def base(**edits: Any) -> Template:
    doc = example_doc(BASE_FILE)
    for key, value in edits.items():
        set_path(doc, key.replace("__", "."), value)
    return parse_template(doc)


def base_contract(memory_mib: int = 512) -> CompatibilityContract:
    return freeze(base(spec__memory__size_mib=memory_mib))


def base_images() -> list[dict[str, Any]]:
    """The guest `base` pins, as a heartbeat lists it (the simulated node's edu-demo image)."""
    t = base()
    pinned = {"digest": t.guest_image_digest, "kernel_release": t.guest_kernel.version}
    return [image(**pinned, kernel_digests=[t.guest_kernel.digest], modules_img_digest=t.modules_img.digest)]


# ---- the template and its contract ----------------------------------------------------------------------------


def test_the_base_example_is_a_consistent_cpu_only_template_without_an_accelerator_section() -> None:
    t = base()
    assert t.cpu_only and (t.accel_class, t.backend, t.devices, t.hotplug) == (
        NO_ACCELERATOR,
        NO_ACCELERATOR,
        (),
        False,
    )
    assert check_template(t) == []
    doc = t.to_json()
    assert "accelerator" not in doc["spec"]  # written as the operator wrote it
    again = Template.from_json(doc)
    assert again == t and freeze(again).digest == freeze(t).digest
    assert freeze(t).guest_probes().pci == ()  # the agent looks for no PCI device


@pytest.mark.parametrize(
    ("field", "value", "found"),
    [
        ("spec.hotplug", True, "hotplug: true"),
        ("spec.cuda", {"version": "12.4"}, "cuda"),
        ("spec.driver", {"kernel": {"module": "nvidia", "version": "550.54.15"}}, "driver"),
        ("spec.accelerator", {"class": "none", "backend": "vfio", "devices": []}, "accelerator.backend 'vfio'"),
        (
            "spec.accelerator",
            {"class": "none", "backend": "none", "devices": [{"vendor_id": "10de", "device_id": "2330"}]},
            "accelerator.devices",
        ),
    ],
)
def test_a_cpu_only_template_carrying_a_device_stack_is_refused_at_registration(
    field: str, value: Any, found: str
) -> None:
    doc = set_path(example_doc(BASE_FILE), field, value)
    codes = {v.code: v for v in check_template(parse_template(doc))}
    assert found in codes["compat.template_cpu_only_with_device_stack"].found
    assert codes["compat.template_cpu_only_with_device_stack"].layer.value == "template"


def test_an_accelerator_template_still_needs_its_devices_and_hot_plug() -> None:
    doc = set_path(example_doc(EXAMPLES / "edu-demo.yaml"), "spec.accelerator.devices", [])
    assert "compat.host_hardware_none_listed" in {v.code for v in check_template(parse_template(doc))}


def test_stage_2_asks_a_node_only_for_lockable_memory_and_the_guest_it_boots() -> None:
    t = base()
    bare = NodeSummary(backends=frozenset(), devices=[], pinnable_memory_mib=512, guest_images=())
    images = tuple(view("n", images=base_images()).guest_images)
    ok = NodeSummary(backends=frozenset(), devices=[], pinnable_memory_mib=512, guest_images=images)
    assert check_node(t, ok) == []  # no backend, no device, no hot-plug path: nothing of it is asked for
    small = NodeSummary(backends=frozenset(), devices=[], pinnable_memory_mib=511, guest_images=images)
    assert [v.code for v in check_node(t, small)] == ["compat.node_pinned_memory_insufficient"]
    assert {v.code for v in check_node(t, bare)} == {
        "compat.node_guest_kernel_unavailable",
        "compat.node_guest_image_unavailable",
    }
    unpinned = base(spec__memory__pinned=False)
    assert check_node(unpinned, small) == []


def test_stage_5_judges_the_guest_without_expecting_a_device() -> None:
    t = base()
    report = GuestReport(agent_version=1, kernel_release=t.guest_kernel.version)
    assert check_guest(t, report) == []
    wrong = GuestReport(agent_version=1, kernel_release="5.10.0-1-amd64")
    assert [v.code for v in check_guest(t, wrong)] == ["compat.guest_kernel_mismatch"]


def test_a_create_naming_only_a_template_asks_for_no_device_when_it_is_cpu_only() -> None:
    assert for_template(NO_ACCELERATOR).primary == NO_DEVICES and NO_DEVICES.cpu_only
    assert for_template("gpu").primary == AcceleratorChoice("gpu", 1) and not for_template("gpu").primary.cpu_only


# ---- placement --------------------------------------------------------------------------------------------------


def place(nodes: list[NodeView], contract: CompatibilityContract | None = None) -> tuple[list[str], dict[str, str]]:
    d = decide(nodes, [(NO_DEVICES, contract or base_contract(), None)], NOW, STALE)
    return [x.node.name for x in d.candidates], {n: r.label for n, r in d.outcomes[-1].reasons.items()}


def test_a_node_with_no_devices_no_backend_and_no_hot_plug_hosts_a_cpu_only_sandbox() -> None:
    bare = view("bare", backends=(), hotplug=(), images=base_images(), received_at=NOW)
    placed, reasons = place([bare])
    assert placed == ["bare"] and reasons == {}
    d = decide([bare], [(NO_DEVICES, base_contract(), None)], NOW, STALE)
    assert d.candidates[0].group == CPU_GROUP and d.choice == NO_DEVICES


def test_cpu_only_work_goes_where_it_costs_devices_least_then_where_memory_is_freest() -> None:
    gpus = view("gpus", group(H100, 8), images=base_images(), received_at=NOW)
    busy = view("busy", group(H100, 8, free=1), images=base_images(), received_at=NOW)
    cpu_small = view("cpu-small", images=base_images(), pinnable=4096, received_at=NOW)
    cpu_big = view("cpu-big", images=base_images(), pinnable=8192, received_at=NOW)
    placed, _ = place([gpus, busy, cpu_small, cpu_big])
    assert placed == ["cpu-big", "cpu-small", "busy", "gpus"]


@pytest.mark.parametrize(
    ("node", "reason"),
    [
        (view("n", received_at=NOW - 11), "node_stale"),
        (view("n", state="draining", received_at=NOW), "node_draining"),
        (view("n", host_problems=[("host.no_iommu", "no IOMMU")], received_at=NOW), "host_not_ready"),
        (view("n", pinnable=100, received_at=NOW), "pinned_memory"),
        (view("n", images=[], received_at=NOW), "kernel_incompatible"),
    ],
)
def test_a_refused_cpu_only_placement_names_each_nodes_reason(node: NodeView, reason: str) -> None:
    assert place([node]) == ([], {"n": reason})


def test_a_gpu_request_never_lands_on_a_cpu_only_decision_and_vice_versa() -> None:
    n = view("n", group(H100, 8, free=0), images=base_images(), received_at=NOW)
    placed, _ = place([n])
    assert placed == ["n"]  # no free device on it: a CPU-only sandbox does not care
    err = decide([n], [(AcceleratorChoice("gpu", 1), freeze(parse_template(example_doc())), None)], NOW, STALE)
    assert err.candidates == []


NODE = st.tuples(
    st.integers(0, 4),  # free H100s (0..total 4); 0 with no group at all when total is 0
    st.sampled_from(["ready", "draining"]),
    st.booleans(),  # stale
    st.sampled_from([100, 512, 600, 4096, 1 << 20]),  # pinnable MiB
    st.booleans(),  # holds the pinned guest image
    st.booleans(),  # host ready
)


@settings(max_examples=150, deadline=None)
@given(st.lists(NODE, min_size=1, max_size=10), st.sampled_from([256, 512, 2048]), st.booleans())
def test_cpu_only_placement_is_every_fit_node_and_the_three_paths_agree(
    spec: list[tuple[int, str, bool, int, bool, bool]], memory: int, pinned: bool
) -> None:
    """The fast scan, the index and the thorough filters pick the same nodes in the same order, and those are
    exactly the fresh, ready nodes whose lockable memory (when pinned) and guest fit — whatever their devices."""
    contract = freeze(base(spec__memory__size_mib=memory, spec__memory__pinned=pinned))
    nodes = []
    for i, (free, state, stale, pinnable, has_image, ready) in enumerate(spec):
        groups = [group(H100, 4, free)] if free else []
        nodes.append(
            view(
                f"n{i:02d}",
                *groups,
                state=state,
                pinnable=pinnable,
                images=base_images() if has_image else [],
                host_problems=None if ready else [("host.no_iommu", "no IOMMU")],
                received_at=NOW - (20 if stale else 0),
            )
        )
    ctx = Context(NO_DEVICES, contract, None, NOW, STALE)
    index = NodeIndex()
    for v in nodes:
        index.put(v)
    fast, slow, indexed = evaluate(nodes, ctx, keep=100), explain(nodes, ctx), evaluate_indexed(index, ctx, 100)
    order = [x.node.name for x in slow.candidates]
    assert [x.node.name for x in fast.candidates] == order == [x.node.name for x in indexed.candidates]
    fit = {
        f"n{i:02d}"
        for i, (_, state, stale, pinnable, has_image, ready) in enumerate(spec)
        if state == "ready" and not stale and ready and has_image and (not pinned or pinnable >= memory)
    }
    assert set(order) == fit
    assert all(x.group == CPU_GROUP for x in slow.candidates)
    if not fit:
        assert set(fast.reasons) == {n.name for n in nodes}


# ---- the claim and quotas ----------------------------------------------------------------------------------------


@pytest.fixture
def store(tmp_path: Path) -> Iterator[MasterStore]:
    s = MasterStore(str(tmp_path / "m.db"))
    yield s
    s.close()


def test_a_cpu_only_claim_takes_no_device_but_the_nodes_lockable_memory(store: MasterStore) -> None:
    store.heartbeat(view_body("n", pinnable=1024), time.time(), 10)
    for sid in ("a", "b", "c"):
        store.insert_sandbox(sandbox_row(sid, time.time(), count=0))
    now = time.time()
    assert store.admit("a", "n", CPU_GROUP.key, 0, now, 10, 512, accel_class=NO_ACCELERATOR)
    assert store.admit("b", "n", CPU_GROUP.key, 0, now, 10, 512, accel_class=NO_ACCELERATOR)
    assert not store.admit("c", "n", CPU_GROUP.key, 0, now, 10, 512, accel_class=NO_ACCELERATOR)  # memory spent
    v = store.all_node_views()[0]
    assert v.admitted_memory_mib == 1024 and all(v.free(g) == g.allocatable for g in v.groups)


def test_cpu_only_sandboxes_count_against_the_sandbox_quota_and_never_a_device_quota(store: MasterStore) -> None:
    Auth(store).create_tenant("t", Quota(max_sandboxes=2, max_accelerators={"gpu": 0, "accelerator": 0}))
    store.heartbeat(view_body("n"), time.time(), 10)
    for sid in ("a", "b", "c"):
        store.insert_sandbox(sandbox_row(sid, time.time(), count=0))
    now = time.time()
    for sid in ("a", "b"):
        assert store.admit(sid, "n", CPU_GROUP.key, 0, now, 10, 512, tenant="t", accel_class=NO_ACCELERATOR)
    with pytest.raises(CubeError) as e:
        store.admit("c", "n", CPU_GROUP.key, 0, now, 10, 512, tenant="t", accel_class=NO_ACCELERATOR)
    assert e.value.code == "quota.sandboxes"


def view_body(name: str, pinnable: int = 1 << 20) -> dict[str, Any]:
    return heartbeat(name, group(H100, 2), pinnable=pinnable, images=base_images())
