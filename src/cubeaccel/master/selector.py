"""CEL selectors over device attributes, behind a small wrapper so the CEL runtime stays replaceable.

A selector is compiled once at submission (a compile error or a non-boolean expression is a 422 with
`selector.*`), then evaluated against capacity-group labels. The labels are bound as `device`, a
map(string, string): `device.model.startsWith("H100") && int(device.memory_gib) >= 80`.

Evaluation is memoised per label set: a cluster has thousands of nodes but only a handful of distinct
device kinds, so a selector is evaluated a handful of times per request, not once per device.
A runtime error (a missing key, a bad `int()`) means "does not match", never a crash.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

from cel_expr_python import cel  # type: ignore[import-untyped]

from cubeaccel.protocol.errors import CubeError

_ENV_LOCK = threading.Lock()
_ENV: cel.Env | None = None
_COMPILED: dict[str, Selector] = {}
MAX_CACHED = 1024


def _env() -> cel.Env:
    global _ENV
    with _ENV_LOCK:
        if _ENV is None:
            _ENV = cel.NewEnv(variables={"device": cel.Type.Map(cel.Type.STRING, cel.Type.STRING)})
        return _ENV


class Selector:
    """A compiled boolean CEL expression over `device` labels."""

    def __init__(self, expression: str) -> None:
        self.expression = expression
        try:
            self._expr = _env().compile(expression)
        except RuntimeError as e:
            raise CubeError(
                "selector.compile_error",
                f"selector does not compile: {_first_line(e)}",
                "api",
                {"selector": expression, "error": str(e)},
            ) from e
        kind = self._expr.return_type().name()
        if kind not in ("bool", "BOOL", "dyn", "DYN"):
            raise CubeError(
                "selector.not_boolean",
                f"selector must be a boolean expression, it is {kind}",
                "api",
                {"selector": expression, "type": kind},
            )
        self._memo: dict[frozenset[tuple[str, str]], bool] = {}
        self.evaluations = 0  # how often CEL actually ran (the bench and tests read it)

    def matches(self, labels: Mapping[str, str]) -> bool:
        key = frozenset(labels.items())
        hit = self._memo.get(key)
        if hit is not None:
            return hit
        result = self.evaluate(labels)
        if len(self._memo) < MAX_CACHED:
            self._memo[key] = result
        return result

    def evaluate(self, labels: Mapping[str, str]) -> bool:
        """Run CEL now, without the memo (the brute-force baseline uses this)."""
        self.evaluations += 1
        try:
            value = self._expr.eval(data={"device": dict(labels)}).value()
        except RuntimeError:
            return False
        return value is True


def compile_selector(expression: str) -> Selector:
    """Compiled selectors are shared (their memo too): the same text means the same function."""
    sel = _COMPILED.get(expression)
    if sel is None:
        sel = Selector(expression)
        if len(_COMPILED) < MAX_CACHED:
            _COMPILED[expression] = sel
    return sel


def _first_line(e: Exception) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__
