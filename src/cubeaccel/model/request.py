"""What a user asks for: an accelerator class, a count, an optional CEL selector, ordered alternatives.

Pure values and parsing; no I/O. The CEL text is only carried here — compiling it is CubeMaster's job
(`master.selector`), so that `model/` stays free of the CEL runtime. The `"H100:2"` shorthand means
"2 GPUs whose model label is H100 or starts with `H100-`"; `"gpu:2"` means any 2 GPUs.

Every refusal is a `CubeError` with a stable `request.*` code and status 422.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cubeaccel.model.device import AcceleratorClass
from cubeaccel.model.template_spec import NO_ACCELERATOR
from cubeaccel.protocol.errors import CubeError

MAX_COUNT = 64  # the most devices one Cubelet reservation may take (Cubelet's own limit)
MAX_ALTERNATIVES = 8
MAX_SELECTOR_CHARS = 2000
CLASSES = tuple(c.value for c in AcceleratorClass)
_SHORTHAND = re.compile(r"(?P<model>[A-Za-z0-9][A-Za-z0-9._-]{0,63})(?::(?P<count>[0-9]{1,12}))?")
_CHOICE_FIELDS = frozenset({"class", "count", "selector", "model"})


def _bad(code: str, message: str, **details: Any) -> CubeError:
    return CubeError(code, message, "api", details, 422)


@dataclass(frozen=True)
class AcceleratorChoice:
    """One acceptable shape: `count` devices of `accel_class`, all from one capacity group of one node."""

    accel_class: str
    count: int = 1
    selector: str | None = None  # CEL over the device's labels, bound as `device`
    model: str | None = None  # model label, exact or as a `MODEL-` prefix (case-insensitive)

    def model_matches(self, model_label: str) -> bool:
        if self.model is None:
            return True
        want, have = self.model.lower(), model_label.lower()
        return have == want or have.startswith(want + "-")

    @property
    def cpu_only(self) -> bool:
        """No device: what a CPU-only template's sandbox asks for (never a user's own count, which is 1..64)."""
        return self.count == 0

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"class": self.accel_class, "count": self.count}
        if self.selector is not None:
            out["selector"] = self.selector
        if self.model is not None:
            out["model"] = self.model
        return out


@dataclass(frozen=True)
class AcceleratorRequest:
    """Ordered choices: the first that fits on any node wins; nodes are scored within it."""

    choices: tuple[AcceleratorChoice, ...]

    @property
    def primary(self) -> AcceleratorChoice:
        return self.choices[0]

    def to_json(self) -> dict[str, Any]:
        first = self.primary.to_json()
        if len(self.choices) > 1:
            first["alternatives"] = [c.to_json() for c in self.choices[1:]]
        return first


def for_template(accel_class: str) -> AcceleratorRequest:
    """The request a create that names only a template makes: one device of its class, or none for a CPU-only one."""
    return AcceleratorRequest((AcceleratorChoice(accel_class, 0 if accel_class == NO_ACCELERATOR else 1),))


def validate_count(count: object) -> int:
    if isinstance(count, bool) or not isinstance(count, int):
        raise _bad("request.invalid_count", f"count must be an integer, got {count!r}")
    if not 1 <= count <= MAX_COUNT:
        raise _bad("request.invalid_count", f"count must be 1..{MAX_COUNT}, got {count}", count=count)
    return count


def validate_class(accel_class: object) -> str:
    if not isinstance(accel_class, str) or accel_class not in CLASSES:
        raise _bad(
            "request.unknown_class",
            f"unknown accelerator class {accel_class!r}; known: {list(CLASSES)}",
            known=list(CLASSES),
        )
    return accel_class


def parse_shorthand(text: object) -> AcceleratorRequest:
    """`"H100:2"` → 2 GPUs of model H100*; `"H100"` → 1; `"gpu:4"` → any 4 GPUs."""
    if not isinstance(text, str):
        raise _bad("request.invalid_shorthand", f"shorthand must be a string like 'H100:2', got {text!r}")
    m = _SHORTHAND.fullmatch(text.strip())
    if m is None:
        raise _bad(
            "request.invalid_shorthand",
            f"invalid accelerator shorthand {text!r}: expected MODEL[:COUNT], e.g. 'H100:2' or 'gpu:1'",
            shorthand=text,
        )
    count = validate_count(int(m["count"])) if m["count"] is not None else 1
    token = m["model"]
    if token.lower() in CLASSES:
        return AcceleratorRequest((AcceleratorChoice(token.lower(), count),))
    return AcceleratorRequest((AcceleratorChoice(AcceleratorClass.GPU.value, count, model=token),))


def _choice(data: object, where: str) -> AcceleratorChoice:
    if not isinstance(data, Mapping):
        raise _bad("request.invalid_accelerator", f"{where}: expected an object, got {type(data).__name__}")
    unknown = sorted(set(data) - _CHOICE_FIELDS - ({"alternatives"} if where == "accelerators[0]" else set()))
    if unknown:
        raise _bad("api.unknown_field", f"{where}: unknown field(s) {unknown}", fields=unknown)
    selector = data.get("selector")
    if selector is not None and (not isinstance(selector, str) or not 0 < len(selector) <= MAX_SELECTOR_CHARS):
        raise _bad("selector.invalid", f"{where}.selector must be a CEL string of 1..{MAX_SELECTOR_CHARS} chars")
    model = data.get("model")
    if model is not None and (not isinstance(model, str) or _SHORTHAND.fullmatch(model) is None or ":" in model):
        raise _bad("request.invalid_model", f"{where}.model must be a model name like 'H100', got {model!r}")
    return AcceleratorChoice(
        validate_class(data.get("class", AcceleratorClass.GPU.value)),
        validate_count(data.get("count", 1)),
        selector,
        model,
    )


def parse_accelerators(items: object) -> AcceleratorRequest:
    """The long form: `[{class, count, selector, alternatives: [{class, count, selector}, ...]}]`.

    One entry per request: a sandbox's devices come from one capacity group of one node (one Cubelet
    reservation); several different device kinds in one sandbox are refused with a code, not guessed at.
    """
    if not isinstance(items, list) or not items:
        raise _bad("request.invalid_accelerator", "accelerators must be a non-empty list")
    if len(items) > 1:
        raise _bad(
            "request.multiple_accelerator_kinds",
            "one accelerator entry per sandbox (use alternatives for fallbacks)",
            entries=len(items),
        )
    first = items[0]
    primary = _choice(first, "accelerators[0]")
    alts = first.get("alternatives", []) if isinstance(first, Mapping) else []
    if not isinstance(alts, list) or len(alts) > MAX_ALTERNATIVES:
        raise _bad("request.invalid_alternatives", f"alternatives must be a list of at most {MAX_ALTERNATIVES}")
    return AcceleratorRequest((primary, *(_choice(a, f"alternatives[{i}]") for i, a in enumerate(alts))))
