"""Warm pools of a template version CubeMaster has since superseded (docs/warm.md): a create by template name
resolves to the latest registered version, so a node's pool of an earlier one is never matched — its warm
sandboxes would keep their devices and pinned memory with no create to claim them. CubeMaster asks such a node to
keep the same pool of the latest version instead; the Cubelet's `set_pool` drops the old pool and releases its
unclaimed warm sandboxes (`warm.superseded`), then refills from the new document.

Only a pool whose contract digest is a registered earlier version of its template is rebuilt: a pool of a
document CubeMaster never registered (a node's own `--warm` file, perhaps newer) is the node operator's.
Pure over node views and the registered versions; the calls are maintenance's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from cubeaccel.master.records import TemplateRecord
from cubeaccel.master.view import NodeView
from cubeaccel.master.warm import node_eligible
from cubeaccel.model.contract import CompatibilityContract
from cubeaccel.wire.warm import WarmPoolBody


@dataclass(frozen=True)
class Versions:
    """One template's registered versions, as a pool is judged against them: the latest's frozen contract (what a
    create by name copies) and the digests of the versions registered before it."""

    latest: CompatibilityContract
    earlier: frozenset[str]


@dataclass(frozen=True)
class Rebuild:
    node: str
    cubelet_url: str
    pool: str  # the superseded pool's key
    body: WarmPoolBody  # the same pool of the latest version (size, class, count, vCPUs kept)


def versions_of(records: Sequence[TemplateRecord], latest: Mapping[str, CompatibilityContract]) -> dict[str, Versions]:
    """Per template name in `latest`, its earlier versions' digests (`records` in registration order)."""
    out: dict[str, Versions] = {}
    for name, contract in latest.items():
        digests = [r.digest for r in records if r.name == name]
        out[name] = Versions(contract, frozenset(digests[:-1]) - {contract.digest})
    return out


def superseded(
    views: Sequence[NodeView], versions: Mapping[str, Versions], now: float, staleness_s: float
) -> list[Rebuild]:
    """The pools on fresh, ready nodes whose template has a later registered version, each with the body that
    keeps the same pool of the latest."""
    out: list[Rebuild] = []
    for v in views:
        if not node_eligible(v, now, staleness_s):
            continue
        for p in v.warm_pools:
            known = versions.get(p.template or "")
            if known is None or p.contract_digest not in known.earlier or known.latest.accel_class != p.accel_class:
                continue  # a name reused for another class is not this pool's next version
            c = known.latest
            body = WarmPoolBody.model_validate(
                {
                    "size": p.size,
                    "count": p.count,
                    "class": p.accel_class,
                    "memory_mib": c.memory_mib,
                    "vcpus": p.vcpus,
                    "pin_memory": c.pin_memory,
                    "contract": c.to_json(),
                    "template": c.template_name,
                }
            )
            out.append(Rebuild(v.name, v.cubelet_url, p.key, body))
    return out
