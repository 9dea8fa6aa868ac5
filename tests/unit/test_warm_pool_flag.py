"""`cubelet serve --warm TEMPLATE_FILE=SIZE` keeps sandboxes of the shape CubeMaster asks for that template: a pool
whose memory or pinning differs from the template's is a pool no create ever matches (CubeMaster compares the
advertised shape field by field, docs/warm.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cubeaccel.cli.cubelet import _warm_request
from cubeaccel.master.up import EXAMPLES
from cubeaccel.wire.templates import load_template


@pytest.mark.parametrize("name", ["edu-demo.yaml", "cuda12-h100.yaml"])
def test_a_warm_pool_from_a_template_file_has_the_templates_memory_and_pinning(name: str) -> None:
    path = Path(str(EXAMPLES / name))  # an installed package's files, on disk
    t = load_template(path)
    req = _warm_request(path)
    assert (req.memory_mib, req.pin_memory, req.accel_class, req.template) == (
        t.memory_mib,
        t.pin_memory,
        t.accel_class,
        t.name,
    )
