"""Which template snapshots this node prepares, derived from what it serves and the devices it has.

A template start restores only a state saved from its exact machine, and a machine's root ports are shaped by
BARs (model/snapshot_layouts.py). So a snapshot is planned per template and per machine its sandboxes will
have on this node: the template's image, memory and vCPUs, and the BAR layouts of the node's devices its
contract admits (for sandboxes without a template, `--prepare-shape`: one per machine their devices can give).
The plan is made from the journal's devices, the same list a start's spec is made from, at host initialization
and again whenever the devices' layouts change (reconcile registered a new one); each plan is queued once.

What it serves: `--prepare-template` files, the templates of its warm pools, and `--prepare-shape` sizes.
Templates whose sandboxes always boot cold (a NIC, scratch disk or mount) get none.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cubeaccel.model.event_kinds import EventKind
from cubeaccel.model.snapshot_layouts import snapshot_layouts
from cubeaccel.protocol.errors import CubeError
from cubeaccel.wire.snapshot import SnapshotPlan

if TYPE_CHECKING:
    from cubeaccel.cubelet.lifecycle import ReservationRequest
    from cubeaccel.cubelet.ports import SnapshotHost

# a plan's outcome: (the plan, the preparer's answer (key, created, build_s), or the error)
DoneFn = Callable[[SnapshotPlan, dict[str, object] | None, CubeError | None], None]
# queues plans to be made in the background, each outcome told to the callback (ProcessShimDriver.prepare_snapshots)
PrepareFn = Callable[[Sequence[SnapshotPlan], DoneFn], None]


@dataclass(frozen=True)
class Shape:
    """A `--prepare-shape`: a machine size for sandboxes without a template."""

    memory_mib: int
    vcpus: int = 1


class TemplateSnapshots:
    """Plans the node's snapshots and hands each new plan to `prepare` (the process driver's queue) once; each
    outcome comes back to `prepared`."""

    def __init__(
        self,
        cubelet: SnapshotHost,
        prepare: PrepareFn,
        templates: Sequence[ReservationRequest] = (),
        shapes: Sequence[Shape] = (),
    ) -> None:
        self.cubelet = cubelet
        self.prepare = prepare
        self.templates = tuple(templates)
        self.shapes = tuple(shapes)
        self._queued: set[SnapshotPlan] = set()
        self._lock = threading.Lock()

    def plans(self) -> list[SnapshotPlan]:
        """Every snapshot the node should hold now (a template that no longer validates here is left out)."""
        devices = self.cubelet.store.devices()
        out: list[SnapshotPlan] = []
        for req in (*self.templates, *(p.request for p in list(self.cubelet.warm.pools.values()))):
            try:
                contract, params = self.cubelet.request_params(req)
            except CubeError:
                continue  # refused for a reservation too: no sandbox of it will start here
            fs = contract.template.sandbox.filesystem if contract is not None else None
            if params.network is not None or (fs is not None and (fs.scratch_mib is not None or fs.readonly_mounts)):
                continue  # always cold (model/cold_start.py): a snapshot would never be restored
            image = contract.template.guest_image_digest if contract is not None else self._default_image()
            if image is None:
                continue
            for bars in snapshot_layouts(contract, devices):
                out.append(
                    SnapshotPlan(
                        template=req.template or (contract.template_name if contract is not None else None),
                        image_digest=image,
                        memory_mib=params.memory_mib,
                        vcpus=params.vcpus,
                        template_bars=bars,
                    )
                )
        default = self._default_image()
        for shape in self.shapes:
            out += [
                SnapshotPlan(image_digest=default, memory_mib=shape.memory_mib, vcpus=shape.vcpus, template_bars=bars)
                for bars in snapshot_layouts(None, devices)
                if default is not None
            ]
        return list(dict.fromkeys(out))

    def refresh(self) -> list[SnapshotPlan]:
        """Queue the plans not queued before (host initialization, then after each reconcile pass): an event each."""
        with self._lock:
            new = [p for p in self.plans() if p not in self._queued]
            self._queued.update(new)
        if new:
            with self.cubelet.store.tx() as t:
                for p in new:
                    t.event(EventKind.TEMPLATE_SNAPSHOT_QUEUED, "cubelet", details=_details(p))
            self.prepare(new, self.prepared)
        return new

    def prepared(self, plan: SnapshotPlan, result: dict[str, object] | None, error: CubeError | None) -> None:
        """The preparer's outcome, as an event: the state's key and whether it was made now, or why not. A failed
        plan is not retried in a loop: a restart, or `cubeaccel template prepare`, tries it again."""
        with self.cubelet.store.tx() as t:
            if error is None:
                t.event(EventKind.TEMPLATE_SNAPSHOT_READY, "cubelet", details={**_details(plan), **(result or {})})
            else:
                t.event(
                    EventKind.TEMPLATE_SNAPSHOT_FAILED,
                    "cubelet",
                    reason=error.code,
                    details={**_details(plan), "message": error.message[:500], **error.details},
                )

    def _default_image(self) -> str | None:
        return self.cubelet.shim.node_facts().default_image


def _details(p: SnapshotPlan) -> dict[str, object]:
    return {"plan": p.label, **p.model_dump(mode="json", exclude={"v"})}
