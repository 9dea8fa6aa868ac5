"""The reset ladder's rule (model/reset_ladder.py): which rung runs, and when a bus reset is refused."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from cubeaccel.model.reset_ladder import (
    BUS_METHODS,
    FUNCTION_METHODS,
    KNOWN_METHODS,
    Reached,
    ResetFacts,
    Rung,
    next_step,
)

DEV = "0000:01:00.0"
ALL = frozenset(KNOWN_METHODS)


def _facts(
    methods: tuple[str, ...], reach: tuple[Reached, ...] | None = (Reached(DEV, 7),), **kw: object
) -> ResetFacts:
    return ResetFacts(DEV, 7, methods, ALL, reach, **kw)  # type: ignore[arg-type]


def test_flr_first_then_bus_then_quarantine() -> None:
    f = _facts(("flr", "bus"))
    assert (s := next_step(f)).rung is Rung.FUNCTION and s.methods == ("flr",)
    f = _facts(("flr", "bus"), function_tried=True)
    assert (s := next_step(f)).rung is Rung.BUS and s.methods == ("bus",)
    s = next_step(_facts(("flr", "bus"), function_tried=True, bus_tried=True))
    assert (s.rung, s.code) == (Rung.QUARANTINE, "backend.reset_failed")


def test_a_function_with_only_a_bus_reset_gets_the_bus_rung_when_alone_in_its_group() -> None:
    assert next_step(_facts(("bus",))).rung is Rung.BUS


def test_no_allowed_method_or_no_bus_on_the_root_bus_is_quarantined() -> None:
    s = next_step(ResetFacts(DEV, 7, ("flr",), frozenset({"bus"}), None))
    assert (s.rung, s.code) == (Rung.QUARANTINE, "backend.reset_not_allowed")
    s = next_step(_facts(("bus",), reach=None))
    assert (s.rung, s.code) == (Rung.QUARANTINE, "backend.no_reset_method")
    s = next_step(_facts(("flr",), reach=None, function_tried=True))
    assert (s.rung, s.code) == (Rung.QUARANTINE, "backend.reset_failed")


def test_bus_reset_reaching_a_function_of_another_group_is_refused_with_it_named() -> None:
    reach = (Reached(DEV, 7), Reached("0000:01:00.1", 8))
    s = next_step(_facts(("bus",), reach=reach))
    assert (s.rung, s.code) == (Rung.QUARANTINE, "backend.bus_reset_refused")
    assert s.refused == ("0000:01:00.1(IOMMU group 8, not 7)",) and "0000:01:00.1" in s.reason


def test_bus_reset_reaching_a_busy_function_of_the_same_group_is_refused() -> None:
    reach = (Reached(DEV, 7), Reached("0000:01:00.1", 7, busy="attached to sandbox sb-2"))
    s = next_step(_facts(("flr", "bus"), reach=reach, function_tried=True))
    assert (s.rung, s.code) == (Rung.QUARANTINE, "backend.bus_reset_refused")
    assert s.refused == ("0000:01:00.1(attached to sandbox sb-2)",)


def test_a_vendor_preference_starts_at_the_bus_rung_and_falls_back_to_flr_when_it_is_refused() -> None:
    assert next_step(_facts(("flr", "bus"), prefer_bus=True)).rung is Rung.BUS
    reach = (Reached(DEV, 7), Reached("0000:01:00.1", 9))
    s = next_step(_facts(("flr", "bus"), reach=reach, prefer_bus=True))
    assert s.rung is Rung.FUNCTION and s.refused == ("0000:01:00.1(IOMMU group 9, not 7)",)


def test_multifunction_device_whose_kernel_offers_no_bus_reset_is_quarantined_naming_the_reach() -> None:
    reach = (Reached(DEV, 7), Reached("0000:01:00.1", 7))
    s = next_step(_facts(("pm",), reach=reach, function_tried=True))
    assert (s.rung, s.code) == (Rung.QUARANTINE, "backend.reset_failed") and "0000:01:00.1" in s.reason


# ---- properties over random topologies --------------------------------------------------------------------------

_groups = st.one_of(st.none(), st.integers(0, 3))
_reached = st.builds(
    Reached,
    address=st.sampled_from([f"0000:01:00.{i}" for i in range(8)] + ["0000:02:00.0"]),
    iommu_group=_groups,
    busy=st.one_of(st.none(), st.sampled_from(["held by 1(qemu)", "attached", "reserved"])),
)
_facts_st = st.builds(
    ResetFacts,
    address=st.just(DEV),
    iommu_group=_groups,
    methods=st.lists(st.sampled_from(sorted(KNOWN_METHODS)), unique=True, max_size=4).map(tuple),
    allowed=st.frozensets(st.sampled_from(sorted(KNOWN_METHODS))),
    reach=st.one_of(st.none(), st.lists(_reached, max_size=5).map(tuple)),
    prefer_bus=st.booleans(),
    function_tried=st.booleans(),
    bus_tried=st.booleans(),
)


@settings(max_examples=500, deadline=None)
@given(_facts_st)
def test_a_bus_step_never_reaches_a_function_outside_the_group_or_a_busy_one(f: ResetFacts) -> None:
    s = next_step(f)
    if s.rung is Rung.BUS:
        assert f.reach is not None and f.iommu_group is not None
        assert all(r.iommu_group == f.iommu_group and r.busy is None for r in f.reach)
        assert s.methods and set(s.methods) <= set(BUS_METHODS) & f.allowed & set(f.methods)
        assert not f.bus_tried
    elif s.rung is Rung.FUNCTION:
        assert set(s.methods) <= set(FUNCTION_METHODS) & f.allowed
        assert s.methods or not f.methods  # the kernel picks only when it reports nothing
        assert not f.function_tried
    else:
        assert s.code is not None and s.code.startswith("backend.")


@settings(max_examples=300, deadline=None)
@given(_facts_st)
def test_the_ladder_ends_in_at_most_three_steps(f: ResetFacts) -> None:
    for _ in range(3):
        s = next_step(f)
        if s.rung is Rung.QUARANTINE:
            return
        f = ResetFacts(
            f.address,
            f.iommu_group,
            f.methods,
            f.allowed,
            f.reach,
            f.prefer_bus,
            function_tried=f.function_tried or s.rung is Rung.FUNCTION,
            bus_tried=f.bus_tried or s.rung is Rung.BUS,
        )
    assert next_step(f).rung is Rung.QUARANTINE
