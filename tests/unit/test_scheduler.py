"""Scheduler filters, scores and alternatives, on node views built from heartbeat bodies."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cubeaccel.master.scheduler import Context, decide, explain, rejection
from cubeaccel.master.selector import Selector
from cubeaccel.master.view import NodeView
from cubeaccel.model.contract import CompatibilityContract
from cubeaccel.model.request import AcceleratorChoice
from tests.support.master_builders import group, h100_contract, heartbeat, image, view
from tests.support.scheduler_oracle import evaluate

NOW, STALE = 1001.0, 10.0
H100 = "H100-PCIe-80GB"


def run(
    nodes: list[NodeView],
    *choices: AcceleratorChoice,
    contract: CompatibilityContract | None = None,
    selector: str | None = None,
) -> tuple[list[str], dict[str, str]]:
    c = contract or h100_contract()
    sel = Selector(selector) if selector else None
    d = decide(nodes, [(ch, c, sel) for ch in choices], NOW, STALE)
    reasons = {n: r.label for n, r in d.outcomes[-1].reasons.items()}
    return [x.node.name for x in d.candidates], reasons


def one(count: int = 1, model: str | None = "H100") -> AcceleratorChoice:
    return AcceleratorChoice("gpu", count, model=model)


@pytest.mark.parametrize(
    ("node", "reason"),
    [
        (view("n", group(H100, 8), received_at=NOW - 11), "node_stale"),
        (view("n", group(H100, 8), state="draining"), "node_draining"),
        (view("n", group(H100, 8, free=0), host_problems=[("host.no_iommu", "no IOMMU")]), "host_not_ready"),
        (view("n", group("edu", 2, cls="accelerator")), "class_missing"),
        (view("n", group("T4-16GB", 4)), "device_incompatible"),
        (view("n", group(H100, 8), backends=("emulated",)), "backend_unsupported"),
        (view("n", group(H100, 8), pinnable=512), "pinned_memory"),
        (view("n", group(H100, 8), hotplug=()), "hotplug_unsupported"),
        (view("n", group(H100, 8), images=[image(kernel_release="5.10.0-1-amd64")]), "kernel_incompatible"),
        (view("n", group(H100, 8), images=[image(kernel_digests=["sha256:" + "5" * 64])]), "kernel_incompatible"),
        (view("n", group(H100, 8), images=[]), "kernel_incompatible"),
        (view("n", group(H100, 8), images=[image(digest="sha256:" + "0" * 64)]), "image_missing"),
        (view("n", group(H100, 8), images=[image(modules_img_digest="sha256:" + "0" * 64)]), "modules_img_missing"),
        (view("n", group(H100, 8, free=0)), "insufficient_devices"),
    ],
)
def test_each_filter_names_its_reason(node: NodeView, reason: str) -> None:
    placed, reasons = run([node], one(model=None))
    assert placed == [] and reasons == {"n": reason}


def test_a_template_pinning_a_kernel_the_node_lacks_is_refused_with_layer_guest_kernel() -> None:
    nodes = [
        view("old", group(H100, 8), images=[image(kernel_release="5.10.0-1-amd64")]),
        view("bare", group(H100, 8), images=[]),
        view("has", group(H100, 8)),
    ]
    assert run(nodes, one())[0] == ["has"]
    d = decide(nodes[:2], [(one(), h100_contract(), None)], NOW, STALE)
    nodes_detail = rejection(d, 2).details["tried"][0]["nodes"]
    assert {n: x["reason"] for n, x in nodes_detail.items()} == {
        "old": "kernel_incompatible",
        "bare": "kernel_incompatible",
    }
    assert nodes_detail["old"]["detail"].startswith("guest_kernel: expected 6.1.0-57-amd64 (sha256:")
    assert nodes_detail["old"]["detail"].endswith("found 5.10.0-1-amd64")
    assert nodes_detail["bare"]["detail"].endswith("found no guest images")


def test_a_heartbeat_without_node_facts_reports_nothing_bootable() -> None:
    """Fail closed: a Cubelet that does not say which guests it holds can host no template."""
    body = heartbeat("legacy", group(H100, 8))
    del body["guest_images"], body["hotplug"]
    from cubeaccel.master.view import view_from_heartbeat

    legacy = view_from_heartbeat(body, NOW)
    assert (legacy.guest_images, legacy.hotplug) == ((), frozenset())
    assert run([legacy], one())[1] == {"legacy": "hotplug_unsupported"}


def test_the_pinned_image_must_carry_the_pinned_kernel_itself() -> None:
    """The kernel present in another image does not help: the shim boots the image by its digest."""
    other = image(digest="sha256:" + "0" * 64)
    wrong_kernel = image(kernel_release="6.1.0-99-cloud-amd64")
    assert run([view("n", group(H100, 8), images=[other, wrong_kernel])], one())[1] == {"n": "kernel_incompatible"}


def test_model_shorthand_mismatch_is_labels_mismatch_model() -> None:
    assert run([view("n", group("T4-16GB", 4))], one(model="B200"))[1] == {"n": "labels_mismatch(model)"}


def test_selector_mismatch_is_its_own_reason() -> None:
    _, reasons = run([view("n", group(H100, 8))], one(), selector="int(device.memory_gib) >= 141")
    assert reasons == {"n": "selector_mismatch"}


def test_selector_sees_class_and_device_ids() -> None:
    placed, _ = run(
        [view("n", group(H100, 8))],
        one(),
        selector="device.class == 'gpu' && device.vendor_id == '10de' && device.device_id == '2331'",
    )
    assert placed == ["n"]


def test_rejection_counts_reasons_per_node_and_keeps_detail() -> None:
    nodes = [view(f"full{i}", group(H100, 2, free=0)) for i in range(7)]
    nodes += [view(f"t4-{i}", group("T4-16GB", 4)) for i in range(3)]
    nodes += [view(f"small{i}", group(H100, 8), pinnable=100) for i in range(2)]
    d = decide(nodes, [(one(), h100_contract(), None)], NOW, STALE)
    err = rejection(d, len(nodes))
    assert err.code == "schedule.unschedulable" and err.status == 409
    tried = err.details["tried"][0]
    assert tried["summary"] == "0/12 nodes: 7 insufficient_devices, 3 labels_mismatch(model), 2 pinned_memory"
    assert tried["nodes"]["t4-0"]["detail"].startswith("model H100* wanted, node has T4-16GB")
    assert "65536" not in tried["nodes"]["small0"]["detail"] and "1024 MiB" in tried["nodes"]["small0"]["detail"]


def test_packing_prefers_the_fullest_node_that_fits() -> None:
    nodes = [view("empty", group(H100, 8)), view("half", group(H100, 8, free=3)), view("one", group(H100, 8, free=1))]
    assert run(nodes, one(2))[0] == ["half", "empty"]
    assert run(nodes, one(1))[0] == ["one", "half", "empty"]


def test_numa_locality_beats_packing_for_multi_device_requests() -> None:
    split = view("split", group(H100, 8, free=4, numa={"0": 2, "1": 2}))
    local = view("local", group(H100, 8, free=6, numa={"0": 2, "1": 4}))
    assert run([split, local], one(4))[0] == ["local", "split"]


def test_claims_reduce_free_devices() -> None:
    n = view("n", group(H100, 2))
    n.admitted = {n.groups[0].key: 2}
    assert run([n], one())[1] == {"n": "insufficient_devices"}


def test_first_alternative_that_fits_anywhere_wins() -> None:
    nodes = [view("a", group(H100, 2)), view("b", group(H100, 8))]
    d = decide(nodes, [(one(4), h100_contract(), None), (one(1), h100_contract(), None)], NOW, STALE)
    assert d.choice is not None and d.choice.count == 4 and [c.node.name for c in d.candidates] == ["b"]
    d = decide(nodes, [(one(16), h100_contract(), None), (one(2), h100_contract(), None)], NOW, STALE)
    assert d.choice is not None and d.choice.count == 2 and len(d.outcomes) == 2
    assert [c.node.name for c in d.candidates] == ["a", "b"]


def test_rejection_reports_every_alternative_tried() -> None:
    d = decide(
        [view("a", group(H100, 1))], [(one(4), h100_contract(), None), (one(2), h100_contract(), None)], NOW, STALE
    )
    err = rejection(d, 1)
    assert [t["accelerator"]["count"] for t in err.details["tried"]] == [4, 2]


def test_contract_check_runs_once_per_node_view_and_digest() -> None:
    n = view("n", group(H100, 8))
    c = h100_contract()
    for _ in range(50):
        run([n], one(), contract=c)
    # One entry: the key is the digest and the node's free lockable memory, unchanged here.
    assert len(n.contract_memo) == 1 and next(iter(n.contract_memo)).startswith(c.digest)


NODE = st.tuples(
    st.sampled_from([H100, "T4-16GB", "A100-SXM4-80GB"]),
    st.integers(1, 8),
    st.integers(0, 8),
    st.sampled_from(["ready", "draining"]),
    st.booleans(),
    st.sampled_from([("vfio",), ("emulated",)]),
    st.sampled_from([512, 1 << 20]),
)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(NODE, min_size=1, max_size=12),
    st.integers(1, 4),
    st.sampled_from([None, "H100", "T4"]),
    st.sampled_from([None, "device.architecture == 'hopper'", "int(device.memory_gib) > 20"]),
)
def test_fast_path_picks_exactly_what_the_thorough_filters_allow(
    spec: list[tuple[str, int, int, str, bool, tuple[str, ...], int]],
    count: int,
    model: str | None,
    selector: str | None,
) -> None:
    nodes = []
    for i, (m, total, free, state, stale, backends, pinnable) in enumerate(spec):
        nodes.append(
            view(
                f"n{i:02d}",
                group(m, total, min(free, total), numa={"0": min(free, total)}),
                state=state,
                backends=backends,
                pinnable=pinnable,
                received_at=NOW - (20 if stale else 0),
            )
        )
    ctx = Context(
        AcceleratorChoice("gpu", count, selector, model),
        h100_contract(),
        Selector(selector) if selector else None,
        NOW,
        STALE,
    )
    fast, slow = evaluate(nodes, ctx, keep=100), explain(nodes, ctx)
    assert [(x.node.name, x.group.key) for x in fast.candidates] == [
        (x.node.name, x.group.key) for x in slow.candidates
    ]
    if not fast.candidates:
        assert set(fast.reasons) == {n.name for n in nodes}
