"""The reset ladder between tenants, as one pure rule (issue 27 item 2; docs/vfio.md "The reset ladder").

Rung 1, `function`: the function's own reset (FLR, AF FLR, PM, a device-specific method) — reaches this function
only. Rung 2, `bus`: a secondary bus (or slot) reset of the bus the function sits on — reaches every function on
that bus and everything below them, so it is allowed only when every function it reaches is in the device's own
IOMMU group and idle (no holder, not attached, not reserved); otherwise it is refused with the functions named.
Rung 3, `quarantine`: nothing could reset the device provably, so it is not handed out.

`next_step` is called before each attempt with what the previous attempts found (`function_tried`, `bus_tried`:
that rung ran and the post-reset check failed, or the write failed). The backend reads the facts from the host,
performs the step, checks identity and health, and calls again. No I/O here.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

# Kernel `reset_method` names (drivers/pci/pci.c pci_reset_fn_methods) by what they reach.
FUNCTION_METHODS: tuple[str, ...] = ("device_specific", "acpi", "flr", "af", "pm")
BUS_METHODS: tuple[str, ...] = ("bus", "cxl_bus")
KNOWN_METHODS: frozenset[str] = frozenset(FUNCTION_METHODS + BUS_METHODS)


class Rung(StrEnum):
    FUNCTION = "function"
    BUS = "bus"
    QUARANTINE = "quarantine"


@dataclass(frozen=True)
class Reached:
    """One function a bus reset of the device's bus would reset (the device itself included)."""

    address: str
    iommu_group: int | None
    busy: str | None = None  # why it is not idle ("held by 812(qemu)", "attached to sandbox sb-1"); None: idle


@dataclass(frozen=True)
class ResetFacts:
    address: str
    iommu_group: int | None
    methods: tuple[str, ...]  # the kernel's `reset_method`, in its order; () when the host does not report it
    allowed: frozenset[str]  # the operator's allowed methods
    # Every function a bus reset would reach, the device included; None: no bridge above it (root bus: no bus reset).
    reach: tuple[Reached, ...] | None
    prefer_bus: bool = False  # a vendor's reason to start at rung 2 (backends/nvidia.py)
    function_tried: bool = False
    bus_tried: bool = False


@dataclass(frozen=True)
class ResetStep:
    rung: Rung
    methods: tuple[str, ...] = ()  # what the kernel may use for this attempt; () with FUNCTION: the kernel decides
    code: str | None = None  # the quarantine reason (rung QUARANTINE only)
    reason: str = ""
    refused: tuple[str, ...] = ()  # functions that kept the bus rung from running, each with why


@dataclass(frozen=True)
class ResetAttempt:
    """One rung tried or refused, as the release's event records it (`reset_ladder` in its evidence)."""

    step: ResetStep
    check: tuple[str, ...] | None = None  # the post-reset check's codes; None: not run (the quarantine rung)

    @property
    def ok(self) -> bool:
        return self.step.rung is not Rung.QUARANTINE and not self.check

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {"rung": self.step.rung.value, "reason": self.step.reason}
        if self.step.rung is Rung.QUARANTINE:
            out["code"] = self.step.code
        else:
            out["methods"] = list(self.step.methods)
            out["check"] = list(self.check or ())
            out["ok"] = self.ok
        if self.step.refused:
            out["refused"] = list(self.step.refused)
        return out


def bus_offenders(facts: ResetFacts) -> tuple[str, ...]:
    """The functions a bus reset would reach that are outside the device's group or busy, each with why.
    Empty when a bus reset is safe (or there is no bus to reset: see `reach`)."""
    out = [] if facts.iommu_group is not None else [f"{facts.address}(no IOMMU group)"]
    for r in facts.reach or ():
        if facts.iommu_group is None and r.address == facts.address:
            continue
        if facts.iommu_group is None or r.iommu_group != facts.iommu_group:
            group = "no IOMMU group" if r.iommu_group is None else f"IOMMU group {r.iommu_group}"
            out.append(f"{r.address}({group}, not {facts.iommu_group})")
        elif r.busy is not None:
            out.append(f"{r.address}({r.busy})")
    return tuple(out)


def _ordered(methods: tuple[str, ...], kind: tuple[str, ...], allowed: frozenset[str]) -> tuple[str, ...]:
    return tuple(m for m in methods if m in kind and m in allowed)


def next_step(facts: ResetFacts) -> ResetStep:
    """Which rung to run next, or quarantine with a reason. Never a bus step reaching a function outside the
    device's IOMMU group or a busy one."""
    if not facts.methods:  # unreported (a simulated host): the kernel picks, as it always did; one attempt
        if facts.function_tried or facts.bus_tried:
            return _quarantine("backend.reset_failed", "the reset did not take", facts)
        return ResetStep(Rung.FUNCTION, (), reason="reset methods not reported: the kernel picks")
    fn = _ordered(facts.methods, FUNCTION_METHODS, facts.allowed)
    bus = _ordered(facts.methods, BUS_METHODS, facts.allowed)
    if not fn and not bus and not (facts.function_tried or facts.bus_tried):
        return ResetStep(
            Rung.QUARANTINE,
            code="backend.reset_not_allowed",
            reason=f"{facts.address} offers reset methods {list(facts.methods)}, none of {sorted(facts.allowed)}",
        )
    function_left = bool(fn) and not facts.function_tried
    if function_left and not facts.prefer_bus:
        return ResetStep(Rung.FUNCTION, fn, reason="the function's own reset")
    # rung 2
    offenders = bus_offenders(facts)
    blocked: ResetStep | None = None
    if facts.bus_tried:
        blocked = _quarantine("backend.reset_failed", "the bus reset did not take", facts)
    elif facts.reach is None:
        blocked = _quarantine("backend.no_bus_reset", f"{facts.address} is on a root bus: no bridge to reset", facts)
    elif offenders:
        blocked = ResetStep(
            Rung.QUARANTINE,
            code="backend.bus_reset_refused",
            reason=f"a bus reset of {facts.address} would also reset {', '.join(offenders)}",
            refused=offenders,
        )
    elif not bus:
        reached = ", ".join(r.address for r in facts.reach if r.address != facts.address) or "nothing else"
        blocked = _quarantine(
            "backend.bus_reset_unavailable",
            f"the kernel offers no bus reset for {facts.address} (methods {list(facts.methods)}; it would reach "
            f"{reached})",
            facts,
        )
    if blocked is None:
        why = "preferred by the vendor" if facts.prefer_bus and function_left else "the function's reset is missing"
        if facts.function_tried:
            why = "the function's reset did not take"
        return ResetStep(Rung.BUS, bus, reason=why)
    if function_left:  # the vendor preferred the bus rung, which cannot run: the function's reset still can
        return ResetStep(Rung.FUNCTION, fn, reason=f"bus rung unavailable: {blocked.reason}", refused=blocked.refused)
    if (
        not facts.function_tried
        and not fn
        and blocked.code in ("backend.no_bus_reset", "backend.bus_reset_unavailable")
    ):
        return ResetStep(Rung.QUARANTINE, code="backend.no_reset_method", reason=blocked.reason)
    return blocked


def _quarantine(code: str, reason: str, facts: ResetFacts) -> ResetStep:
    if facts.function_tried and code != "backend.reset_failed":
        return ResetStep(
            Rung.QUARANTINE, code="backend.reset_failed", reason=f"the function's reset did not take; {reason}"
        )
    return ResetStep(Rung.QUARANTINE, code=code, reason=reason)
