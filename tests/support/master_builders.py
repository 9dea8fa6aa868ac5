"""Heartbeat bodies and node views in the agreed shape (docs/api.md capacity + heartbeat fields)."""

from __future__ import annotations

from typing import Any

import httpx

from cubeaccel.cubelet.shim_driver import simulated_guest_images
from cubeaccel.master.records import SandboxRow
from cubeaccel.master.view import NodeView, view_from_heartbeat
from cubeaccel.model.contract import CompatibilityContract, freeze
from cubeaccel.model.node_facts import HOTPLUG_PCIE_ROOT_PORT_ACPI
from cubeaccel.transport import node_sig
from tests.support.contract_builders import template

MODELS = {
    "H100-PCIe-80GB": {"vendor": "nvidia", "memory_gib": "80", "architecture": "hopper"},
    "T4-16GB": {"vendor": "nvidia", "memory_gib": "16", "architecture": "turing"},
    "A100-SXM4-80GB": {"vendor": "nvidia", "memory_gib": "80", "architecture": "ampere"},
}


def sandbox_row(sid: str, at: float, **over: Any) -> SandboxRow:
    """A CubeMaster sandbox row as `insert_sandbox` takes it: born `scheduling`, nothing placed yet."""
    return SandboxRow.from_columns(sandbox_columns(sid, at, **over))


def sandbox_columns(sid: str, at: float, **over: Any) -> dict[str, Any]:
    """The columns of `sandbox_row`, as the database holds them."""
    return {
        "id": sid,
        "tenant": "t",
        "idempotency_key": None,
        "request": {},
        "state": "scheduling",
        "count": 1,
        "device_ids": [],
        "timeline": [],
        "created_at": at,
        "updated_at": at,
        **over,
    }


def group(
    model: str,
    total: int,
    free: int | None = None,
    numa: dict[str, int] | None = None,
    backend: str = "vfio",
    cls: str = "gpu",
) -> dict[str, Any]:
    free = total if free is None else free
    return {
        "class": cls,
        "labels": {**MODELS.get(model, {}), "model": model, "backend": backend},
        "total": total,
        "by_state": {"allocatable": free, "attached": total - free},
        "allocatable_by_numa": numa if numa is not None else {"0": free},
    }


# the guests the example templates pin: a node "has everything" unless a test says otherwise
EXAMPLE_IMAGES = [i.to_json() for i in simulated_guest_images()]


def image(**changes: Any) -> dict[str, Any]:
    """The H100 example's pinned guest as a heartbeat entry, with fields replaced."""
    return {**EXAMPLE_IMAGES[0], **changes}


def heartbeat(
    node: str,
    *groups: dict[str, Any],
    backends: tuple[str, ...] = ("vfio",),
    pinnable: int = 1 << 20,
    images: list[dict[str, Any]] | None = None,
    hotplug: tuple[str, ...] = (HOTPLUG_PCIE_ROOT_PORT_ACPI,),
    url: str = "http://127.0.0.1:1",
    host_problems: list[tuple[str, str]] | None = None,
    pinned: dict[str, Any] | None = None,
    max_devices: int | None = None,
) -> dict[str, Any]:
    """`host_problems`: the host is not ready, for these (code, message); `pinned`: the pinned_memory ledger;
    `max_devices`: the advertised per-sandbox device limit (None: an older Cubelet's heartbeat, without it)."""
    body = {
        "node": node,
        "cubelet_url": url,
        "version": "0.1.0",
        "sent_at": 1000.0,
        "capacity": {
            "node": node,
            "backends": list(backends),
            "groups": list(groups),
            "total": sum(g["total"] for g in groups),
        },
        "pinnable_memory_mib": pinnable,
        "guest_images": EXAMPLE_IMAGES if images is None else images,
        "hotplug": list(hotplug),
    }
    if host_problems is not None:
        body.update(ready=not host_problems, host_problems=[{"code": c, "message": m} for c, m in host_problems])
    if pinned is not None:
        body["pinned_memory"] = pinned
    if max_devices is not None:
        body["max_devices_per_sandbox"] = max_devices
    return body


def view(*args: Any, received_at: float = 1000.0, state: str = "ready", **kw: Any) -> NodeView:
    return view_from_heartbeat(heartbeat(*args, **kw), received_at, state)


def h100_contract(memory_mib: int = 1024) -> CompatibilityContract:
    return freeze(template(spec__memory__size_mib=memory_mib))


class Credentials(httpx.Auth):
    """What each caller of an in-process CubeMaster would present: a node's PUTs under /v1/nodes/NODE carry
    that node's signature (its token enrolled on first use), everything else the admin key."""

    requires_request_body = True

    def __init__(self, master: Any) -> None:
        from cubeaccel.master.auth import ADMIN

        self.master = master
        _, self.admin = master.auth.create_key(ADMIN)
        self.tokens: dict[str, str] = {}

    def auth_flow(self, request: httpx.Request) -> Any:
        parts = request.url.path.split("/")
        if request.method == "PUT" and parts[1:3] == ["v1", "nodes"] and len(parts) > 3:
            node = parts[3]
            if node not in self.tokens:
                self.tokens[node] = self.master.auth.enrol_node(node)
            target = node_sig.target_of(request.url.path, request.url.query)
            request.headers.update(node_sig.sign(self.tokens[node], request.method, target, request.content))
        else:
            request.headers["Authorization"] = f"Bearer {self.admin}"
        yield request
