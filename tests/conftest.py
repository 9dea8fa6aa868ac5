from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from cubeaccel.model import error_catalog
from tests.support.cubelet_harness import Node


@pytest.fixture(autouse=True)
def catalogued_error_codes(request: pytest.FixtureRequest) -> Iterator[list[str]]:
    """The runtime half of the error-catalog guard: every CubeError / ContractViolation built in this process
    during a test must carry a catalogued code (and the catalog's HTTP status). Opt out with
    `@pytest.mark.uncatalogued_codes` where a test builds foreign codes on purpose."""
    seen: list[str] = []
    previous = error_catalog.set_observer(seen.append)
    try:
        yield seen
    finally:
        error_catalog.set_observer(previous)
    if request.node.get_closest_marker("uncatalogued_codes") is None:
        assert not seen, "uncatalogued error codes: " + "; ".join(sorted(set(seen)))


@pytest.fixture
def node(tmp_path: Path) -> Node:
    return Node.create(tmp_path, "h100x8")
