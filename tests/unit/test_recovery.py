"""The quarantine reasons' table and the retry schedule (model/recovery.py)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from cubeaccel.model.recovery import (
    QUARANTINE_REASONS,
    RETRY_BASE_S,
    RETRY_CAP_S,
    RETRY_LIMIT,
    Recovery,
    recovery_of,
    retry_delay,
    retry_due,
)
from cubeaccel.protocol.error_catalog import CODES

CATALOG = {c.code: c for c in CODES}
TRANSIENT = sorted(r for r, c in QUARANTINE_REASONS.items() if c is Recovery.TRANSIENT)


def test_every_quarantine_code_is_classed_and_every_classed_code_is_catalogued() -> None:
    assert set(QUARANTINE_REASONS) <= set(CATALOG)
    quarantines = {c.code for c in CODES if c.meaning.startswith("quarantine:")}
    assert quarantines <= set(QUARANTINE_REASONS), quarantines - set(QUARANTINE_REASONS)


def test_a_reason_nobody_classed_waits_for_the_operator() -> None:
    assert recovery_of("backend.something_new") is Recovery.PERMANENT and recovery_of(None) is Recovery.PERMANENT
    assert recovery_of("release.scrub_vm_not_started") is Recovery.TRANSIENT
    assert recovery_of("release.scrub_failed") is Recovery.PERMANENT  # a scrub that ran and did not verify
    assert recovery_of("release.scrub_image_unavailable") is Recovery.HOST_FACT  # nothing ran: the image was missing


@given(st.integers(1, 200))
def test_the_wait_doubles_from_the_base_and_never_passes_the_cap(attempt: int) -> None:
    d = retry_delay(attempt)
    assert RETRY_BASE_S <= d <= RETRY_CAP_S
    assert retry_delay(attempt + 1) in (min(RETRY_CAP_S, 2 * d), RETRY_CAP_S)


@given(st.sampled_from(TRANSIENT), st.integers(0, 50), st.floats(0, 1e7, allow_nan=False))
def test_a_transient_reason_is_retried_only_within_the_bound_and_after_its_wait(
    reason: str, attempts: int, waited: float
) -> None:
    due = retry_due(reason, attempts, waited)
    assert due == (attempts < RETRY_LIMIT and waited >= retry_delay(attempts + 1))


@given(
    st.sampled_from(sorted(r for r, c in QUARANTINE_REASONS.items() if c is Recovery.PERMANENT)),
    st.integers(0, 50),
    st.floats(0, 1e9, allow_nan=False),
)
def test_a_permanent_reason_is_never_due(reason: str, attempts: int, waited: float) -> None:
    assert not retry_due(reason, attempts, waited)


@given(
    st.sampled_from(sorted(r for r, c in QUARANTINE_REASONS.items() if c is Recovery.HOST_FACT)),
    st.integers(0, 50),
    st.floats(0, 1e9, allow_nan=False),
    st.booleans(),
)
def test_a_host_fact_reason_is_due_when_its_fact_is_back_whatever_the_wait_within_the_bound(
    reason: str, attempts: int, waited: float, back: bool
) -> None:
    """A missing scrub image: no attempt is spent while it is missing, none waits once it is there."""
    assert retry_due(reason, attempts, waited, host_fact_back=back) == (back and attempts < RETRY_LIMIT)


@given(st.sampled_from(sorted(QUARANTINE_REASONS)), st.integers(0, 50), st.floats(0, 1e9, allow_nan=False))
def test_only_a_host_fact_reason_listens_to_its_fact(reason: str, attempts: int, waited: float) -> None:
    if QUARANTINE_REASONS[reason] is not Recovery.HOST_FACT:
        assert retry_due(reason, attempts, waited, host_fact_back=True) == retry_due(reason, attempts, waited)


def test_a_whole_episode_ends_within_a_bounded_time() -> None:
    total = sum(retry_delay(n) for n in range(1, RETRY_LIMIT + 1))
    assert total <= RETRY_LIMIT * RETRY_CAP_S and total < 2 * 3600  # an operator hears of it within two hours
