"""`cubeaccel host discover` on a fake tree: table and JSON, accelerators and --all."""

from __future__ import annotations

import json
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from cubeaccel.backends.vfio_spec import DeviceSpec
from cubeaccel.cli import app
from cubeaccel.protocol.errors import CubeError
from tests.support.fake_sysfs import Dev, FakeSysfs


def _fake(tmp_path: Path) -> FakeSysfs:
    return FakeSysfs.build(
        tmp_path,
        [Dev("0000:18:00.0", device=0x2330, iommu_group=5),
         Dev("0000:18:00.1", device=0x22A3, class_code=0x040300, iommu_group=5, driver="snd_hda_intel"),
         Dev("0000:99:00.0", vendor=0x1AF4, device=0x1041, class_code=0x020000, driver=None, iommu_group=9)],
    )  # fmt: skip


def test_discover_json_lists_accelerators_and_all_functions(tmp_path: Path) -> None:
    fake = _fake(tmp_path)
    result = CliRunner().invoke(app, ["host", "discover", "--sysfs-root", str(fake.sys), "--all", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert [a["address"] for a in out["accelerators"]] == ["0000:18:00.0"]
    assert out["accelerators"][0]["labels"]["model"] == "H100-SXM5-80GB"
    assert [f["address"] for f in out["functions"]] == ["0000:18:00.0", "0000:18:00.1", "0000:99:00.0"]
    assert fake.writes == []


def test_discover_table_and_a_bad_pattern(tmp_path: Path) -> None:
    fake = _fake(tmp_path)
    result = CliRunner().invoke(app, ["host", "discover", "--sysfs-root", str(fake.sys), "--all"])
    assert result.exit_code == 0 and "H100-SXM5-80GB" in result.output and "0000:99:00.0" in result.output
    result = CliRunner().invoke(app, ["host", "discover", "--sysfs-root", str(fake.sys), "--allow", "10de:../"])
    assert result.exit_code == 2 and "backend.invalid_allow_pattern" in result.output


@given(st.text(max_size=40))
def test_allow_patterns_either_parse_to_a_fixed_point_or_fail_with_a_code(text: str) -> None:
    try:
        spec = DeviceSpec.parse(text)
    except CubeError as e:
        assert e.code == "backend.invalid_allow_pattern"
        return
    assert DeviceSpec.parse(str(spec)) == spec
    assert "/" not in str(spec) and "\n" not in str(spec)
