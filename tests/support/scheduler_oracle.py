"""The scheduler's linear scan, kept as the oracle the indexed path (`scheduler.evaluate_indexed`) is checked
against: the same filters as `explain`, one pass over every node, no index."""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from cubeaccel.master.scheduler import (
    Candidate,
    ChoiceOutcome,
    Context,
    _evaluate_cpu,
    _group_ok,
    _node_contract_ok,
    _over_limit,
    explain,
    score,
)
from cubeaccel.master.view import Group, NodeView
from cubeaccel.model.sandbox_states import NodeState


def evaluate(nodes: Sequence[NodeView], ctx: Context, keep: int = 16) -> ChoiceOutcome:
    """The `keep` best candidates, with verdicts memoised per label set and per node view.

    Same filters as `explain`, without building reasons: only when nothing fits does the thorough path
    run, to say why. A decision is then one pass of dictionary lookups over the nodes.
    """
    if ctx.choice.cpu_only:
        return _evaluate_cpu(nodes, ctx, keep)
    verdict: dict[str, bool] = {}
    cutoff, count = ctx.now - ctx.staleness_s, ctx.choice.count
    scored: list[tuple[float, float, float, str, int, Group, NodeView]] = []
    for i, n in enumerate(nodes):
        if n.received_at < cutoff or n.state != NodeState.READY or not n.host_ready or _over_limit(n, count):
            continue
        claims = n.admitted
        for g in n.groups:
            ok = verdict.get(g.key)
            if ok is None:
                ok = verdict[g.key] = _group_ok(g, ctx)
            if not ok or g.allocatable - claims.get(g.key, 0) < count:
                continue
            if not _node_contract_ok(n, ctx):
                break
            numa, pack, node_free = score(n, g, count)
            scored.append((-numa, -pack, -node_free, n.name, i, g, n))
    if not scored:
        return explain(nodes, ctx)
    best = heapq.nsmallest(keep, scored, key=lambda x: x[:5])
    return ChoiceOutcome(ctx.choice, [Candidate(x[6], x[5], (-x[0], -x[1], -x[2])) for x in best], {})
