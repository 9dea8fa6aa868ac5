"""Template snapshots across processes: what the Cubelet asks `cubeaccel template prepare --plan` to make, and
what a shim's start says about the one it looked up (`VmStarted.snapshot`).

A plan names the machine by what the sandboxes of that template will carry in their spec (image, memory,
vCPUs, backend, `template_bars`), not by a template key: the key also hashes host facts (accel, the QEMU
binary) that only the preparing process reads, exactly as the shim reads them at a start.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, StrictInt, StrictStr

from cubeaccel.model.bars import Bar, human_bytes
from cubeaccel.wire.base import Lenient, Message
from cubeaccel.wire.shim_spec import Bars

TemplateName = Annotated[StrictStr, Field(min_length=1, max_length=128)]
SnapshotKey = Annotated[StrictStr, Field(max_length=64)]  # a template key (16 hex digits today), as the shim said


class SnapshotPlan(Message):
    """One machine a node prepares a template snapshot of, at host initialization or when its devices change."""

    template: TemplateName | None = None  # the template it is for; None: sandboxes without one (`--prepare-shape`)
    image_digest: Annotated[StrictStr, Field(pattern=r"^sha256:[0-9a-f]{64}$")]
    memory_mib: Annotated[StrictInt, Field(ge=64, le=4 << 20)]
    vcpus: Annotated[StrictInt, Field(ge=1, le=256)] = 1
    memory_backend: Literal["ram", "memfd", "hugepages"] = "ram"
    # BAR layouts every root port must fit (model/snapshot_layouts.py): those its sandboxes' specs will carry
    template_bars: tuple[Bars, ...] = Field(default=(), max_length=64)

    @property
    def label(self) -> str:
        return plan_label(self.template, self.memory_mib, self.vcpus, self.template_bars)


def plan_label(template: str | None, memory_mib: int, vcpus: int, template_bars: tuple[tuple[Bar, ...], ...]) -> str:
    """How events, logs and a state's `meta.json` name a plan: the template (or `shape`), its memory and vCPUs,
    the widest BAR its machine is shaped for."""
    widest = max((b.size for layout in template_bars for b in layout), default=0)
    bar = f", BAR {human_bytes(widest)}" if widest else ""
    return f"{template or 'shape'} {memory_mib} MiB x {vcpus}{bar}"


class SnapshotLookup(Lenient):
    """A template start's lookup: the machine's key and, restored, what its state was prepared for; cold, why no
    prepared state matched (the nearest one and which of the machine's fields differ from it)."""

    key: SnapshotKey
    prepared_for: tuple[StrictStr, ...] = ()  # restored: the plans (labels) the state was prepared for
    prepared: StrictInt = 0  # states this node holds
    nearest: SnapshotKey | None = None  # cold: the prepared state that differs in the fewest fields
    differs: tuple[StrictStr, ...] = ()  # cold: those fields (image, memory_mib, vcpus, shape, accel, qemu, ...)
    why: StrictStr = ""  # cold: one sentence
