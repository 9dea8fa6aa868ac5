"""Strict JSON for everything a client or a guest sends: one parser, one walk, stable codes.

Python's `json` accepts what JSON does not (`NaN`, `Infinity`, a duplicated key where the last one silently
wins, a byte-order mark if decoded loosely) and turns 1e400 into an infinite float; nesting deep enough to
exhaust the recursion limit raises `RecursionError`, which no handler expects. Every listener runs bodies
through `loads` before a route sees them, and values typed `Any` (report details, heartbeat facts) are
walked by `check_value`, so a number that reaches the database, a comparison or `os.kill` is finite and bounded.
"""

from __future__ import annotations

import codecs
import json
import math
from typing import Any

MAX_DEPTH = 32  # deepest legitimate body (a template document) is under 10
INT64 = 2**63  # what SQLite and PostgreSQL integers hold; also far above any pid, size or count


class JsonRefused(ValueError):
    """Why a body or value is refused, with the stable code the API edge answers with (HTTP 422)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def check_value(
    value: Any, max_depth: int = MAX_DEPTH, int_bound: int | None = None, max_nodes: int | None = None
) -> None:
    """Refuse non-finite numbers, nesting deeper than `max_depth` and, with `int_bound`, integers outside
    ±int_bound; with `max_nodes`, more values than that (YAML aliases can share one list exponentially often).
    Iterative, so a hostile depth cannot exhaust the stack here."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    seen = 0
    while stack:
        v, depth = stack.pop()
        seen += 1
        if max_nodes is not None and seen > max_nodes:
            raise JsonRefused("api.too_many_values", f"more than {max_nodes} values")
        if isinstance(v, float):
            if not math.isfinite(v):
                raise JsonRefused("api.non_finite_number", f"a number must be finite, got {v!r}")
        elif isinstance(v, int) and not isinstance(v, bool):
            if int_bound is not None and not -int_bound <= v < int_bound:
                raise JsonRefused("api.number_out_of_range", f"an integer must lie within ±2^63, got {str(v)[:40]}")
        elif isinstance(v, dict | list | tuple):
            if depth > max_depth:
                raise JsonRefused("api.too_deep", f"nesting deeper than {max_depth} levels")
            stack.extend((x, depth + 1) for x in (v.values() if isinstance(v, dict) else v))


def _no_constant(name: str) -> Any:
    raise JsonRefused("api.non_finite_number", f"{name} is not JSON")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise JsonRefused("api.duplicate_key", f"key {k[:60]!r} appears twice in one object")
        out[k] = v
    return out


def loads(data: bytes | str) -> Any:
    """Parse one JSON document strictly; `JsonRefused` (a ValueError) names the code when it is refused."""
    if isinstance(data, bytes):
        if data.startswith(codecs.BOM_UTF8):
            raise JsonRefused("api.byte_order_mark", "a JSON body must not start with a byte-order mark")
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise JsonRefused("api.malformed_json", f"body is not UTF-8: {e}") from None
    elif data.startswith("\ufeff"):
        raise JsonRefused("api.byte_order_mark", "a JSON body must not start with a byte-order mark")
    try:
        value = json.loads(data, parse_constant=_no_constant, object_pairs_hook=_unique_keys)
    except JsonRefused:
        raise
    except RecursionError:
        raise JsonRefused("api.too_deep", f"nesting deeper than {MAX_DEPTH} levels") from None
    except ValueError as e:
        raise JsonRefused("api.malformed_json", f"not valid JSON: {str(e)[:200]}") from None
    check_value(value)
    return value
