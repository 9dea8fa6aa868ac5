"""Heartbeat bodies and node views in the agreed shape (docs/api.md capacity + heartbeat fields)."""

from __future__ import annotations

from typing import Any

from cubeaccel.master.view import NodeView, view_from_heartbeat
from cubeaccel.model.contract import CompatibilityContract, freeze
from tests.unit.contract_builders import template

MODELS = {
    "H100-SXM5-80GB": {"vendor": "nvidia", "memory_gib": "80", "architecture": "hopper"},
    "T4-16GB": {"vendor": "nvidia", "memory_gib": "16", "architecture": "turing"},
    "A100-SXM4-80GB": {"vendor": "nvidia", "memory_gib": "80", "architecture": "ampere"},
}


def group(model: str, total: int, free: int | None = None, numa: dict[str, int] | None = None,
          backend: str = "vfio", cls: str = "gpu") -> dict[str, Any]:
    free = total if free is None else free
    return {"class": cls, "labels": {**MODELS.get(model, {}), "model": model, "backend": backend},
            "total": total, "by_state": {"allocatable": free, "attached": total - free},
            "allocatable_by_numa": numa if numa is not None else {"0": free}}


def heartbeat(node: str, *groups: dict[str, Any], backends: tuple[str, ...] = ("vfio",), pinnable: int = 1 << 20,
              kernels: list[str] | None = None, images: list[str] | None = None,
              url: str = "http://127.0.0.1:1", host_problems: list[tuple[str, str]] | None = None,
              pinned: dict[str, Any] | None = None) -> dict[str, Any]:
    """`host_problems`: the host is not ready, for these (code, message); `pinned`: the pinned_memory ledger."""
    body = {"node": node, "cubelet_url": url, "version": "0.1.0", "sent_at": 1000.0,
            "capacity": {"node": node, "backends": list(backends), "groups": list(groups),
                         "total": sum(g["total"] for g in groups)},
            "pinnable_memory_mib": pinnable, "kernels": kernels or [], "images": images or []}
    if host_problems is not None:
        body.update(ready=not host_problems, host_problems=[{"code": c, "message": m} for c, m in host_problems])
    if pinned is not None:
        body["pinned_memory"] = pinned
    return body


def view(*args: Any, received_at: float = 1000.0, state: str = "ready", **kw: Any) -> NodeView:
    return view_from_heartbeat(heartbeat(*args, **kw), received_at, state)


def h100_contract(memory_mib: int = 1024) -> CompatibilityContract:
    return freeze(template(spec__memory__size_mib=memory_mib))
