"""Image flavours: what a guest's root filesystem holds above the validation base (images/rootfs.py).

A flavour is a recipe the builder runs, as a vendor stack is (images/vendor.py): more packages, what the prune
spares, what the build writes after extraction. The two are independent: `--flavour userland --vendor nvidia` is
the userland with NVIDIA's stack on top.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path


def _nothing(_: Path) -> None:
    pass


@dataclass(frozen=True)
class Flavour:
    """`name` is the CLI's `--flavour`; `prefix` starts its image keys and its `latest-` pointer ("" for
    validation, whose keys and pointer are what they always were)."""

    name: str
    prefix: str
    packages: tuple[str, ...] = ()
    keep: tuple[str, ...] = ()  # paths under the validation prune's directories that stay
    keep_dynload: tuple[str, ...] = ()  # python extension modules (name prefixes) that stay
    precompile: tuple[str, ...] = ()  # more python trees compiled to bytecode at build time
    modes: dict[str, int] = field(default_factory=dict)  # cpio modes other than the normalized ones
    before_prune: Callable[[Path], None] = _nothing  # reads package files the prune removes
    install: Callable[[Path], None] = _nothing  # after the base install: configuration, links, checks
    check: Callable[[Path], None] = _nothing  # last, after any vendor stack: what the flavour promises is there


VALIDATION = Flavour("validation", "")
