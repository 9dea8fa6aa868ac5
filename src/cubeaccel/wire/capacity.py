"""The capacity summary a Cubelet serves (`GET /v1/capacity`) and puts in every heartbeat.

Cubelet always sends every field; CubeMaster reads older summaries too, so all have defaults and unknown
fields are ignored. Counts are whole JSON numbers in 0..2^53.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator, Field, StrictStr

from cubeaccel.wire.base import Count, Lenient, LenientMessage


def _labels(raw: Any) -> Any:
    """Label values are strings; a number (an older summary's memory_gib) is read as its text, as before."""
    return {str(k): str(v) for k, v in raw.items()} if isinstance(raw, dict) else raw


class BarFact(Lenient):
    """One BAR of the group's devices, as discovery read it (model/bars.py): what a machine must be shaped for."""

    index: Count
    size: Count
    kind: StrictStr
    prefetch: bool = False


class CapacityGroup(Lenient):
    """Devices of one class with equal summary labels and BARs."""

    accel_class: StrictStr = Field(alias="class")
    labels: Annotated[dict[str, str], BeforeValidator(_labels)] = {}
    total: Count
    by_state: dict[str, Count] = {}
    allocatable_by_numa: dict[str, Count] = {}
    bars: list[BarFact] = []  # empty: an older Cubelet, or devices recorded before BARs were read


class CapacitySummary(LenientMessage):
    node: str = ""
    backends: list[StrictStr] = []
    total: Count = 0
    by_state: dict[str, Count] = {}
    allocatable: Count = 0
    groups: list[CapacityGroup] = []
    unavailable_reasons: dict[str, Count] = {}

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True)
