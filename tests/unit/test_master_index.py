"""The node index gives the same decisions as the full scan, on randomized clusters and after random changes."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from cubeaccel.master.index import NodeIndex
from cubeaccel.master.scheduler import ChoiceOutcome, Context, decide, evaluate_indexed
from cubeaccel.master.selector import Selector
from cubeaccel.master.view import NodeView
from cubeaccel.model.request import AcceleratorChoice
from tests.support.master_builders import group, h100_contract, view
from tests.support.scheduler_oracle import evaluate

NOW, STALE = 1001.0, 10.0
CONTRACT = h100_contract()
MODELS = ["H100-PCIe-80GB", "H100-PCIE-80GB", "A100-SXM4-80GB", "T4-16GB"]
SELECTORS = [None, Selector("int(device.memory_gib) >= 80")]


@st.composite
def node(draw: st.DrawFn, name: str) -> NodeView:
    groups = []
    for model in draw(st.lists(st.sampled_from(MODELS), min_size=1, max_size=3, unique=True)):
        total = draw(st.integers(1, 8))
        free = draw(st.integers(0, total))
        low = draw(st.integers(0, free))
        groups.append(group(model, total, free, numa={"0": low, "1": free - low}))
    kw: dict[str, Any] = {}
    if draw(st.integers(0, 9)) == 0:
        kw["host_problems"] = [("host.no_iommu", "no IOMMU")]
    if draw(st.integers(0, 9)) == 0:
        kw["pinnable"] = draw(st.sampled_from([512, 1500, 2048, 4096]))  # around the template's 1 GiB + overhead
    if draw(st.integers(0, 9)) == 0:
        kw["images"] = []  # boots nothing: the facts check skips such nodes as a class
    if draw(st.integers(0, 9)) == 0:
        kw["backends"] = ("emulated",)
    return view(
        name,
        *groups,
        received_at=draw(st.sampled_from([NOW, NOW, NOW, NOW - 60])),
        state=draw(st.sampled_from(["ready", "ready", "ready", "draining"])),
        **kw,
    )


@st.composite
def cluster(draw: st.DrawFn) -> list[NodeView]:
    size = draw(st.integers(0, 14))
    views = [draw(node(f"n{i:02d}")) for i in range(size)]
    for v in views:  # placements the summaries cannot show yet
        v.admitted = {g.key: draw(st.integers(0, g.allocatable)) for g in v.groups if draw(st.booleans())}
    return views


choices = st.builds(
    lambda count, model, sel: (AcceleratorChoice("gpu", count, model=model), sel),
    st.integers(1, 4),
    st.sampled_from([None, "H100", "A100", "T4"]),
    st.sampled_from(SELECTORS),
)


def indexed(views: list[NodeView]) -> NodeIndex:
    index = NodeIndex()
    for v in views:
        index.put(v)
    return index


def key(out: ChoiceOutcome) -> tuple[list[tuple[str, str, tuple[float, ...]]], dict[str, str]]:
    return [(c.node.name, c.group.key, c.score) for c in out.candidates], {n: r.label for n, r in out.reasons.items()}


def same(views: list[NodeView], index: NodeIndex, choice: AcceleratorChoice, sel: Selector | None) -> None:
    scan = evaluate(views, Context(choice, CONTRACT, sel, NOW, STALE))
    fast = evaluate_indexed(index, Context(choice, CONTRACT, sel, NOW, STALE))
    assert key(fast) == key(scan)


@settings(max_examples=300, deadline=None)
@given(cluster(), st.lists(choices, min_size=1, max_size=4))
def test_index_and_full_scan_agree_on_candidates_order_and_refusal_reasons(
    views: list[NodeView], asks: list[tuple[AcceleratorChoice, Selector | None]]
) -> None:
    index = indexed(views)
    for choice, sel in asks:
        same(views, index, choice, sel)


@settings(max_examples=200, deadline=None)
@given(cluster(), st.data())
def test_index_kept_incrementally_agrees_after_claims_heartbeats_and_removals(
    views: list[NodeView], data: st.DataObject
) -> None:
    index = indexed(views)
    by_name = {v.name: v for v in views}
    for _ in range(data.draw(st.integers(1, 12))):
        op = data.draw(st.sampled_from(["claim", "release", "heartbeat", "remove", "add"]))
        names = sorted(by_name)
        if op == "add" or not names:
            name = f"new{len(by_name):02d}"
            by_name[name] = data.draw(node(name))
            index.put(by_name[name])
            continue
        name = data.draw(st.sampled_from(names))
        v = by_name[name]
        if op in ("claim", "release"):
            g = data.draw(st.sampled_from(list(v.groups)))
            step = 1 if op == "claim" else -1
            claims = {**v.admitted, g.key: max(0, v.admitted.get(g.key, 0) + step)}
            index.set_admitted(name, claims, v.admitted_memory_mib)
        elif op == "heartbeat":
            fresh = data.draw(node(name))
            fresh.admitted = dict(v.admitted)
            by_name[name] = fresh
            index.put(fresh)
        else:
            del by_name[name]
            index.remove(name)
        choice, sel = data.draw(choices)
        same(list(by_name.values()), index, choice, sel)
    assert sorted(v.name for v in index.views()) == sorted(by_name)


def test_a_decision_visits_the_best_entries_first_not_every_node() -> None:
    """Packing: the node with the fewest free devices that still fit wins, wherever it is in the cluster."""
    views = [view(f"n{i:04d}", group("H100-PCIe-80GB", 8)) for i in range(2000)]
    views.append(view("tight", group("H100-PCIe-80GB", 8, free=2)))
    index = indexed(views)
    d = decide(index.views(), [(AcceleratorChoice("gpu", 2), CONTRACT, None)], NOW, STALE, index=index)
    assert d.candidates[0].node.name == "tight"
    assert [c.node.name for c in d.candidates[1:4]] == ["n0000", "n0001", "n0002"]


def test_a_full_group_leaves_the_index_and_a_release_brings_it_back() -> None:
    v = view("only", group("H100-PCIe-80GB", 2))
    index = indexed([v])
    ask = [(AcceleratorChoice("gpu", 2), CONTRACT, None)]
    gkey = v.groups[0].key
    index.set_admitted("only", {gkey: 2}, 0)
    refused = decide(index.views(), ask, NOW, STALE, index=index)
    assert refused.candidates == [] and {n: r.code for n, r in refused.outcomes[0].reasons.items()} == {
        "only": "insufficient_devices"
    }
    index.set_admitted("only", {}, 0)
    assert [c.node.name for c in decide(index.views(), ask, NOW, STALE, index=index).candidates] == ["only"]
