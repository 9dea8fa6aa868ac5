"""The one way a test waits: poll a condition until a deadline, never sleep blindly."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def poll(fn: Callable[[], T | None], deadline_s: float = 20.0, every_s: float = 0.05, what: str = "") -> T:
    """Return fn()'s first truthy value, or fail when the deadline passes.

    An exception from fn counts as "not yet" (a server still starting), and the last one is named on timeout so
    a stuck wait says why; an AssertionError from fn fails at once (a state the wait can never leave). fn runs
    at least once, and once more at the deadline, so a machine too slow for any tick still sees the final state.
    """
    end = time.monotonic() + deadline_s
    last: object = None
    while True:
        try:
            value = fn()
        except AssertionError:
            raise
        except Exception as e:  # not ready yet
            last = e
        else:
            if value:
                return value
            last = value
        if time.monotonic() >= end:
            label = f" ({what})" if what else ""
            raise AssertionError(f"condition{label} not met within {deadline_s}s (last: {last!r})")
        time.sleep(min(every_s, max(0.0, end - time.monotonic())))
