from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.cubelet_process import CubeletProcess


@pytest.fixture
def cubelet_proc(tmp_path: Path) -> Iterator[CubeletProcess]:
    p = CubeletProcess(tmp_path).start()
    yield p
    p.stop()
