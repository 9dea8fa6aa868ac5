from __future__ import annotations

from pathlib import Path

import pytest

from tests.cubelet_harness import Node


@pytest.fixture
def node(tmp_path: Path) -> Node:
    return Node.create(tmp_path, "h100x8")
