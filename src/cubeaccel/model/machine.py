"""A state machine as data: rules (event, from, to, who may fire it), a lookup, and a refusal that says why.

The device (`states.py`), reservation, sandbox and node machines are instances of `Machine`, so all four refuse
the same way (state, event, allowed events in `details`; 409).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Generic, TypeVar

from cubeaccel.protocol.errors import CubeError

S = TypeVar("S", bound=StrEnum)
E = TypeVar("E", bound=StrEnum)
A = TypeVar("A", bound=StrEnum)


class TransitionRefused(CubeError):
    """A (state, event) pair not in the table, or fired by the wrong actor."""


@dataclass(frozen=True)
class Rule(Generic[S, E, A]):
    event: E
    sources: frozenset[S]
    target: S
    fired_by: frozenset[A]
    precondition: str


def rule(event: E, sources: Iterable[S], target: S, by: Iterable[A], pre: str) -> Rule[S, E, A]:
    return Rule(event, frozenset(sources), target, frozenset(by), pre)


class Machine(Generic[S, E, A]):
    """One table. An event may appear in several rules (different sources, different actors); a
    (state, event) pair in at most one, so the table is a function."""

    def __init__(self, name: str, layer: str, rules: tuple[Rule[S, E, A], ...], codes: tuple[str, str]) -> None:
        self.name = name
        self.layer = layer
        # (refused, actor not allowed): literal catalogued codes, never assembled from the name
        self.refused_code, self.actor_code = codes
        self.rules = rules
        self._by_key: dict[tuple[S, E], Rule[S, E, A]] = {}
        for r in rules:
            for src in r.sources:
                if (src, r.event) in self._by_key:
                    raise ValueError(f"{name}: ({src.value}, {r.event.value}) appears in two rules")
                self._by_key[(src, r.event)] = r

    def lookup(self, state: S, event: E) -> Rule[S, E, A] | None:
        return self._by_key.get((state, event))

    def allowed_events(self, state: S) -> list[E]:
        return sorted({ev for (src, ev) in self._by_key if src == state}, key=lambda e: e.value)

    def sources(self, event: E, actor: A) -> frozenset[S]:
        """The states `actor` may fire `event` from: the guard of a compare-and-swap in a store."""
        return frozenset(src for (src, ev), r in self._by_key.items() if ev == event and actor in r.fired_by)

    def transition(self, state: S, event: E, actor: A) -> S:
        """Return the target state or refuse, naming the current state, the event and what is allowed."""
        r = self._by_key.get((state, event))
        allowed = [e.value for e in self.allowed_events(state)]
        if r is None:
            raise TransitionRefused(
                code=self.refused_code,
                message=f"{self.name} event {event.value!r} is not allowed in state {state.value!r}; "
                f"allowed: {allowed}",
                layer=self.layer,
                details={"state": state.value, "event": event.value, "allowed_events": allowed},
                status=409,
            )
        if actor not in r.fired_by:
            raise TransitionRefused(
                code=self.actor_code,
                message=f"{self.name} event {event.value!r} may be fired by {sorted(a.value for a in r.fired_by)}, "
                f"not {actor.value!r} (state {state.value!r})",
                layer=self.layer,
                details={"state": state.value, "event": event.value, "actor": actor.value},
                status=409,
            )
        return r.target
