"""Placement decisions from node summaries: filters that say why, scores, ordered alternatives.

Each filter is a small function that returns a `Reason` (or None) for one node, so a rejection can
say which constraint failed where: "0/12 nodes: 7 insufficient_devices, 3 labels_mismatch(model),
2 pinned_memory". A node gets the reason of the first filter it fails, in the order of `FILTERS`;
cheap, operator-visible facts (stale, draining, host not ready) first, counts last, so the answer names the real
obstacle rather than its symptom.

The contract stage 2 check (`check_node`) runs once per node view and contract digest, and the CEL
selector once per distinct label set (`Selector` memo), so a decision over 1,000 nodes is mostly
dictionary lookups. Pure: no I/O, no clock (callers pass `now`).
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from cubeaccel.master.index import Entry, NodeIndex, Slot, facts_key
from cubeaccel.master.selector import Selector
from cubeaccel.master.view import Group, NodeView, group_key
from cubeaccel.model.contract import CompatibilityContract, NodeSummary, check_node, label_mismatch
from cubeaccel.model.request import AcceleratorChoice
from cubeaccel.model.sandbox_states import NodeState
from cubeaccel.model.template_spec import NO_ACCELERATOR
from cubeaccel.protocol.errors import CubeError

# check_node's codes → the scheduler's reason names (the layer stays in the detail)
CONTRACT_REASONS = {
    "compat.node_backend_unavailable": "backend_unsupported",
    "compat.node_guest_image_unavailable": "image_missing",
    "compat.node_guest_kernel_unavailable": "kernel_incompatible",
    "compat.node_modules_img_unavailable": "modules_img_missing",
    "compat.node_hotplug_unsupported": "hotplug_unsupported",
    "compat.node_pinned_memory_insufficient": "pinned_memory",
    "compat.node_no_matching_device": "device_incompatible",
}


# The one "group" a CPU-only sandbox is placed in: no labels, no devices; a node's claim of it counts 0 devices.
CPU_GROUP = Group(group_key(NO_ACCELERATOR, {}), NO_ACCELERATOR, {}, {"class": NO_ACCELERATOR}, 0, 0, {})


@dataclass(frozen=True)
class Reason:
    code: str  # node_stale, labels_mismatch, ...
    detail: str  # what was expected and found on this node
    key: str = ""  # the label that failed, for labels_mismatch(model)
    limit: int | None = None  # device_limit: the node's per-sandbox device limit

    @property
    def label(self) -> str:
        return f"{self.code}({self.key})" if self.key else self.code


@dataclass(frozen=True)
class Candidate:
    node: NodeView
    group: Group
    score: tuple[float, ...]  # larger is better

    def to_json(self) -> dict[str, object]:
        return {"node": self.node.name, "group": dict(self.group.labels), "score": list(self.score)}


@dataclass
class Context:
    """Everything one decision needs besides the nodes."""

    choice: AcceleratorChoice
    contract: CompatibilityContract
    selector: Selector | None
    now: float
    staleness_s: float
    matching: list[Group] = field(default_factory=list)  # filled by the group filters for the next ones
    vcpus: int = 1  # with the template's memory: what the sandbox locks on its node (VMM overhead per vCPU)


Filter = Callable[[NodeView, Context], Reason | None]


def node_stale(n: NodeView, c: Context) -> Reason | None:
    if n.stale(c.now, c.staleness_s):
        return Reason("node_stale", f"last heartbeat {c.now - n.received_at:.1f}s ago (> {c.staleness_s:g}s)")
    return None


def node_draining(n: NodeView, c: Context) -> Reason | None:
    return Reason("node_draining", "drained by an operator") if n.state != NodeState.READY else None


def host_not_ready(n: NodeView, c: Context) -> Reason | None:
    """The node's Cubelet says its host cannot serve its backend (no IOMMU, PVM, ...): nothing fits there."""
    if n.host_ready:
        return None
    codes = ", ".join(code for code, _ in n.host_problems) or "no reason given"
    first = f": {n.host_problems[0][1]}" if n.host_problems and n.host_problems[0][1] else ""
    return Reason("host_not_ready", f"{codes}{first}")


def device_limit(n: NodeView, c: Context) -> Reason | None:
    """One sandbox's devices all go into one VM, whose hot-plug slots the node advertises: more than that is
    refused here, before any reservation, however many devices are free (older Cubelets did not say: not filtered)."""
    if not _over_limit(n, c.choice.count):
        return None
    return Reason(
        "device_limit",
        f"{c.choice.count} wanted, one sandbox on this node holds at most {n.max_devices}",
        limit=n.max_devices,
    )


def _over_limit(n: NodeView, count: int) -> bool:
    return n.max_devices is not None and count > n.max_devices


def class_missing(n: NodeView, c: Context) -> Reason | None:
    if c.choice.cpu_only:  # any node may host it: no device class to have
        c.matching = [CPU_GROUP]
        return None
    c.matching = [g for g in n.groups if g.accel_class == c.choice.accel_class]
    if not c.matching:
        have = sorted({g.accel_class for g in n.groups}) or ["no devices"]
        return Reason("class_missing", f"no {c.choice.accel_class} devices (has {', '.join(have)})")
    return None


def labels_mismatch(n: NodeView, c: Context) -> Reason | None:
    if c.choice.model is None:
        return None
    c.matching = [g for g in c.matching if c.choice.model_matches(g.labels.get("model", ""))]
    if not c.matching:
        models = sorted({g.labels.get("model", "?") for g in n.groups if g.accel_class == c.choice.accel_class})
        return Reason("labels_mismatch", f"model {c.choice.model}* wanted, node has {', '.join(models)}", "model")
    return None


def selector_mismatch(n: NodeView, c: Context) -> Reason | None:
    sel = c.selector
    if sel is None:
        return None
    c.matching = [g for g in c.matching if sel.matches(g.attributes)]
    if not c.matching:
        return Reason("selector_mismatch", f"no device satisfies {sel.expression}")
    return None


def contract(n: NodeView, c: Context) -> Reason | None:
    """Contract stage 2: backend, hot-plug, pinned memory, kernel, image, modules.img (check_node), then the
    device kinds."""
    key, headroom = _memo_key(n, c)
    vs = n.contract_memo.get(key)
    if vs is None:
        summary = NodeSummary(
            backends=n.backends,
            devices=[g.attributes for g in n.groups],
            pinnable_memory_mib=headroom,
            guest_images=n.guest_images,
            hotplug=n.hotplug,
            name=n.name,
        )
        vs = n.contract_memo[key] = check_node(c.contract, summary)
    for v in vs:
        if v.code != "compat.node_no_matching_device":
            return Reason(
                CONTRACT_REASONS.get(v.code, v.code), f"{v.layer.value}: expected {v.expected}, found {v.found}"
            )
    if c.choice.cpu_only:
        return None
    before, c.matching = c.matching, [g for g in c.matching if _device_ok(n, g, c.contract)]
    if not c.matching:
        models = ", ".join(sorted({g.labels.get("model", "?") for g in before}))
        return Reason("device_incompatible", f"template {c.contract.template_name} supports none of {models}")
    return None


def _memo_key(n: NodeView, c: Context) -> tuple[str, int]:
    """check_node compares guest RAM with lockable memory; the node's free lockable memory (after claims)
    less the VMM overhead is that comparison made exact. Claims change between heartbeats, so it is in the key."""
    t = c.contract.template
    overhead = n.locked_mib(t.memory_mib, c.vcpus, True) - t.memory_mib
    headroom = n.free_pinnable_mib() - overhead
    return f"{c.contract.digest}@{headroom}", headroom


def insufficient_devices(n: NodeView, c: Context) -> Reason | None:
    if c.choice.cpu_only:
        return None
    c.matching = [g for g in c.matching if n.free(g) >= c.choice.count]
    if not c.matching:
        return Reason(
            "insufficient_devices",
            f"{c.choice.count} wanted, free: "
            + ", ".join(
                f"{g.labels.get('model', '?')}={max(0, n.free(g))}"
                for g in n.groups
                if g.accel_class == c.choice.accel_class
            ),
        )
    return None


def _device_ok(n: NodeView, g: Group, contract: CompatibilityContract) -> bool:
    key = (contract.digest, g.key)
    ok = n.device_memo.get(key)
    if ok is None:
        t = contract.template
        ok = g.labels.get("backend", t.backend) == t.backend and any(
            label_mismatch(m, g.attributes) is None for m in t.devices
        )
        n.device_memo[key] = ok
    return ok


FILTERS: tuple[Filter, ...] = (
    node_stale,
    node_draining,
    host_not_ready,
    device_limit,
    class_missing,
    labels_mismatch,
    selector_mismatch,
    contract,
    insufficient_devices,
)


def score(n: NodeView, g: Group, count: int) -> tuple[float, ...]:
    """NUMA locality first (all devices on one NUMA node), then packing (fewest free left behind).

    A CPU-only sandbox (count 0) goes where it costs devices least: the node with the fewest free devices (a
    node without any first), then the most free lockable memory, so CPU work leaves GPU nodes' memory to GPU work.
    """
    node_free = sum(max(0, n.free(x)) for x in n.groups)
    if count == 0:
        return (1.0, -float(node_free), float(n.free_pinnable_mib()))
    numa_local = 1.0 if count == 1 or any(v >= count for v in g.by_numa.values()) else 0.0
    return (numa_local, -float(n.free(g) - count), -float(node_free))


@dataclass
class ChoiceOutcome:
    choice: AcceleratorChoice
    candidates: list[Candidate]
    reasons: dict[str, Reason]  # node → why not


def explain(nodes: Sequence[NodeView], ctx: Context) -> ChoiceOutcome:
    """The slow, thorough path: every filter in order on every node, keeping each node's reason."""
    candidates: list[Candidate] = []
    reasons: dict[str, Reason] = {}
    for n in nodes:
        for f in FILTERS:
            r = f(n, ctx)
            if r is not None:
                reasons[n.name] = r
                break
        else:
            candidates += [Candidate(n, g, score(n, g, ctx.choice.count)) for g in ctx.matching]
    candidates.sort(key=lambda x: (tuple(-v for v in x.score), x.node.name))  # best first; ties by name
    return ChoiceOutcome(ctx.choice, candidates, reasons)


def _group_ok(g: Group, c: Context) -> bool:
    """The per-label-set filters (class, model, selector, template's device kinds), independent of the node."""
    ch = c.choice
    if g.accel_class != ch.accel_class or not ch.model_matches(g.labels.get("model", "")):
        return False
    if c.selector is not None and not c.selector.matches(g.attributes):
        return False
    t = c.contract.template
    return g.labels.get("backend", t.backend) == t.backend and any(
        label_mismatch(m, g.attributes) is None for m in t.devices
    )


def _node_contract_ok(n: NodeView, c: Context) -> bool:
    key, _ = _memo_key(n, c)
    vs = n.contract_memo.get(key)
    if vs is None:
        contract(n, Context(c.choice, c.contract, None, c.now, c.staleness_s, list(n.groups), c.vcpus))
        vs = n.contract_memo[key]
    return all(v.code == "compat.node_no_matching_device" for v in vs)


def _evaluate_cpu(nodes: Sequence[NodeView], ctx: Context, keep: int) -> ChoiceOutcome:
    """A CPU-only choice: every schedulable node whose lockable memory and guest facts fit the contract. One pass
    over the nodes (the index is keyed by device groups, which a CPU-only sandbox does not use)."""
    cutoff = ctx.now - ctx.staleness_s
    scored: list[tuple[tuple[float, ...], str, NodeView]] = []
    for n in nodes:
        if n.received_at < cutoff or n.state != NodeState.READY or not n.host_ready or not _node_contract_ok(n, ctx):
            continue
        scored.append((tuple(-v for v in score(n, CPU_GROUP, 0)), n.name, n))
    if not scored:
        return explain(nodes, ctx)
    best = heapq.nsmallest(keep, scored, key=lambda x: x[:2])
    return ChoiceOutcome(ctx.choice, [Candidate(x[2], CPU_GROUP, tuple(-v for v in x[0])) for x in best], {})


def evaluate_indexed(index: NodeIndex, ctx: Context, keep: int = 16) -> ChoiceOutcome:
    """The `keep` best candidates from the index, visiting only the entries that can fit (`free >= count`) of the
    label sets that pass, best first, until `keep` pass the node checks; only when nothing fits does the
    thorough path (`explain`) run, to say why. A linear scan giving the same answer is the tests' oracle
    (tests/support/scheduler_oracle.py)."""
    if ctx.choice.cpu_only:
        return _evaluate_cpu(index.views(), ctx, keep)
    count, cutoff = ctx.choice.count, ctx.now - ctx.staleness_s
    t = ctx.contract.template
    verdict: dict[str, bool] = {}
    streams: list[Iterator[tuple[int, int, int, str, int]]] = []
    for slot in index.slots():
        ok = verdict.get(slot.group.key)
        if ok is None:
            ok = verdict[slot.group.key] = _group_ok(slot.group, ctx)
        if (
            not ok
            or _over_limit(slot.node, count)  # the limit is one of the facts the slot's nodes share
            or (t.pin_memory and (1 << slot.memory_bits) - 1 < t.memory_mib)
            or not _facts_ok(index, slot, ctx)
        ):
            continue
        for local, entries in slot.streams(count):
            streams.append(_ranked(0 if local else 1, entries))
    out: list[Candidate] = []
    for _, _, _, name, pos in heapq.merge(*streams):
        n = index.view(name)
        if n.received_at < cutoff or not _node_contract_ok(n, ctx):
            continue
        g = n.groups[pos]
        out.append(Candidate(n, g, score(n, g, count)))
        if len(out) == keep:
            break
    if not out:
        return explain(index.views(), ctx)
    return ChoiceOutcome(ctx.choice, out, {})


def _facts_ok(index: NodeIndex, slot: Slot, ctx: Context) -> bool:
    """Contract stage 2 on the boot facts the slot's nodes share, memory aside (checked per node)."""
    key = (ctx.contract.digest, facts_key(slot.node))
    ok = index.facts_memo.get(key)
    if ok is None:
        n = slot.node
        summary = NodeSummary(
            backends=n.backends,
            devices=[slot.group.attributes],
            pinnable_memory_mib=1 << 62,
            guest_images=n.guest_images,
            hotplug=n.hotplug,
            name=n.name,
        )
        ok = index.facts_memo[key] = all(
            v.code == "compat.node_no_matching_device" for v in check_node(ctx.contract, summary)
        )
    return ok


def _ranked(far: int, entries: Iterator[Entry]) -> Iterator[tuple[int, int, int, str, int]]:
    for free, node_free, name, pos in entries:
        yield far, free, node_free, name, pos


@dataclass
class Decision:
    choice: AcceleratorChoice | None
    contract: CompatibilityContract | None
    candidates: list[Candidate]
    outcomes: list[ChoiceOutcome]


def decide(
    nodes: Sequence[NodeView],
    choices: Sequence[tuple[AcceleratorChoice, CompatibilityContract, Selector | None]],
    now: float,
    staleness_s: float,
    vcpus: int = 1,
    index: NodeIndex | None = None,
) -> Decision:
    """Ordered alternatives: the first choice that fits anywhere wins, its candidates best first. `index` holds
    the same views as `nodes` (CubeMaster's cache keeps one); without it one is built for this decision."""
    if index is None:
        index = NodeIndex()
        for n in nodes:
            index.put(n)
    outcomes = []
    for choice, contract_, selector in choices:
        ctx = Context(choice, contract_, selector, now, staleness_s, vcpus=vcpus)
        out = evaluate_indexed(index, ctx)
        outcomes.append(out)
        if out.candidates:
            return Decision(choice, contract_, out.candidates, outcomes)
    return Decision(None, None, [], outcomes)


def summarize(out: ChoiceOutcome, total: int) -> str:
    counts = Counter(r.label for r in out.reasons.values())
    parts = ", ".join(f"{v} {k}" for k, v in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
    return f"0/{total} nodes: {parts}" if parts else f"0/{total} nodes"


def rejection(decision: Decision, total: int) -> CubeError:
    """One error for the user: counts per reason for every choice tried, plus per-node detail."""
    tried: list[dict[str, Any]] = []
    for out in decision.outcomes:
        tried.append(
            {
                "accelerator": out.choice.to_json(),
                "summary": summarize(out, total),
                "reasons": dict(Counter(r.label for r in out.reasons.values())),
                "nodes": {name: {"reason": r.label, "detail": r.detail} for name, r in sorted(out.reasons.items())},
            }
        )
    head = "; ".join(f"{t['accelerator'].get('model') or t['accelerator']['class']}: {t['summary']}" for t in tried)
    if _only_device_limits(decision):
        most = max(r.limit or 0 for out in decision.outcomes for r in out.reasons.values())
        return CubeError(
            "schedule.too_many_devices",
            f"no node takes this many devices in one sandbox (the most any node takes: {most}); ask for at most "
            f"{most}, or split the work across sandboxes — {head}",
            "scheduler",
            {"nodes_total": total, "max_devices_per_sandbox": most, "tried": tried},
        )
    return CubeError(
        "schedule.unschedulable",
        f"no node can host this sandbox — {head}",
        "scheduler",
        {"nodes_total": total, "tried": tried},
    )


def _only_device_limits(decision: Decision) -> bool:
    """Every node refused every choice for its per-sandbox device limit: no capacity change will help."""
    reasons = [r for out in decision.outcomes for r in out.reasons.values()]
    return bool(reasons) and all(r.code == "device_limit" for r in reasons)
