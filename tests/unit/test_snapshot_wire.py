"""`wire.snapshot.SnapshotPlan`, the Cubelet's message to `cubeaccel template prepare --plan`: what is written is
read back the same, and a plan that says something else is refused by name, before any VM."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError
from typer.testing import CliRunner

from cubeaccel.cli import app
from cubeaccel.model.bars import Bar, BarKind
from cubeaccel.wire.snapshot import SnapshotPlan

DIGEST = "sha256:" + "ab" * 32
_BARS = st.builds(
    Bar, st.integers(0, 5), st.integers(0, 48).map(lambda e: 1 << e), st.sampled_from(BarKind), st.booleans()
)
_LAYOUT = st.lists(_BARS, max_size=6).map(tuple)


@given(
    template=st.none() | st.text(min_size=1, max_size=20),
    memory_mib=st.integers(64, 4 << 20),
    vcpus=st.integers(1, 256),
    backend=st.sampled_from(["ram", "memfd", "hugepages"]),
    layouts=st.lists(_LAYOUT, max_size=4).map(tuple),
)
def test_a_plan_reads_back_as_written(
    template: str | None, memory_mib: int, vcpus: int, backend: str, layouts: tuple[tuple[Bar, ...], ...]
) -> None:
    plan = SnapshotPlan(
        template=template,
        image_digest=DIGEST,
        memory_mib=memory_mib,
        vcpus=vcpus,
        memory_backend=backend,  # type: ignore[arg-type]
        template_bars=layouts,
    )
    again = SnapshotPlan.model_validate_json(plan.model_dump_json())
    assert again == plan and hash(again) == hash(plan) and again.label == plan.label


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"v": 2}, "v"),
        ({"image_digest": "latest"}, "image_digest"),
        ({"memory_mib": 32}, "memory_mib"),
        ({"template_bars": [[{"index": 9, "size": 4096, "kind": "mem32"}]]}, "template_bars"),
        ({"extra": 1}, "extra"),
    ],
)
def test_a_plan_that_says_something_else_is_refused_by_name(change: dict[str, object], field: str) -> None:
    body = {"image_digest": DIGEST, "memory_mib": 256, **change}
    with pytest.raises(ValidationError) as err:
        SnapshotPlan.model_validate(body)
    assert any(e["loc"] and e["loc"][0] == field for e in err.value.errors())


def test_template_prepare_refuses_a_plan_file_it_cannot_read_with_the_catalog_code(tmp_path: Path) -> None:
    bad = tmp_path / "plan.json"
    bad.write_text(json.dumps({"image_digest": DIGEST, "memory_mib": 1}))
    r = CliRunner().invoke(app, ["template", "prepare", "--plan", str(bad), "--json"])
    assert r.exit_code == 1
    error = json.loads(r.output)["error"]
    assert error["code"] == "template.prepare_failed" and "memory_mib" in error["message"]
