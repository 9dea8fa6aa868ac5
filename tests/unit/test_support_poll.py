"""The one wait helper every test uses: it returns the value, honours its deadline, and says why it gave up."""

from __future__ import annotations

import time

import pytest

from tests.support.poll import poll


def test_returns_the_first_truthy_value_once_the_condition_holds() -> None:
    calls: list[int] = []

    def third_time() -> str | None:
        calls.append(1)
        return "ready" if len(calls) >= 3 else None

    assert poll(third_time, 5, 0.001) == "ready"
    assert len(calls) == 3  # stops polling as soon as the value is there


def test_errors_while_waiting_are_not_yet_and_the_last_one_is_named_on_timeout() -> None:
    def refusing() -> bool:
        raise ConnectionRefusedError("socket not up")

    t0 = time.monotonic()
    with pytest.raises(AssertionError, match=r"\(server up\) not met within 0.3s .*socket not up"):
        poll(refusing, 0.3, 0.01, what="server up")
    waited = time.monotonic() - t0
    assert 0.3 <= waited < 2.0  # the deadline is honoured: neither early nor long after


def test_a_falsy_value_at_the_deadline_is_reported() -> None:
    with pytest.raises(AssertionError, match=r"not met within 0.05s \(last: \[\]\)"):
        poll(list, 0.05, 0.01)


def test_a_condition_that_holds_only_at_the_deadline_is_still_seen() -> None:
    """A tick longer than the deadline still checks once more at the deadline instead of failing blind."""
    end = time.monotonic() + 0.2
    assert poll(lambda: time.monotonic() >= end, 0.2, 10.0) is True


def test_an_assertion_in_the_condition_fails_at_once() -> None:
    def exited() -> bool:
        raise AssertionError("the shim exited")

    t0 = time.monotonic()
    with pytest.raises(AssertionError, match="the shim exited"):
        poll(exited, 30, 0.01)
    assert time.monotonic() - t0 < 1.0
