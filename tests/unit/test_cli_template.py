"""`cubeaccel template validate|show`: table rows per violation, JSON output, exit status 0/1."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import typer
import yaml
from typer.testing import CliRunner

from cubeaccel.cli import app
from cubeaccel.model.contract import FrozenContract
from tests.support.contract_builders import EDU_FILE, H100_FILE, example_doc, set_path

runner = CliRunner()


def broken_file(tmp_path: Path) -> Path:
    doc = example_doc()
    set_path(doc, "spec.cuda.version", "12.6")  # needs 560.28.03, template has 550.54.15
    set_path(doc, "spec.memory.pinned", False)  # vfio + hot-plug without pinning
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_validate_accepts_both_examples() -> None:
    for path in (H100_FILE, EDU_FILE):
        result = runner.invoke(app, ["template", "validate", str(path)])
        assert result.exit_code == 0, result.output
        assert "ok" in result.output and "sha256:" in result.output


def test_validate_prints_one_row_per_violation_and_exits_1(tmp_path: Path) -> None:
    result = runner.invoke(app, ["template", "validate", str(broken_file(tmp_path))])
    assert result.exit_code == 1
    rows = [line for line in result.output.splitlines() if "compat." in line]
    assert len(rows) == 2
    assert "cuda_runtime" in rows[0] and "compat.cuda_driver_too_old" in rows[0] and "560.28.03" in rows[0]
    assert "pinned_memory" in rows[1] and "compat.pinned_memory_required" in rows[1]
    for header in ("layer", "code", "expected", "found", "hint"):
        assert header in result.output


def test_validate_json(tmp_path: Path) -> None:
    result = runner.invoke(app, ["template", "validate", "--json", str(broken_file(tmp_path))])
    assert result.exit_code == 1
    out = json.loads(result.output)
    assert out["ok"] is False
    assert [(v["layer"], v["code"]) for v in out["violations"]] == [
        ("cuda_runtime", "compat.cuda_driver_too_old"),
        ("pinned_memory", "compat.pinned_memory_required"),
    ]
    assert set(out["violations"][0]) == {"layer", "code", "expected", "found", "hint"}
    ok = json.loads(runner.invoke(app, ["template", "validate", "--json", str(H100_FILE)]).output)
    assert ok["ok"] is True and ok["template"]["digest"].startswith("sha256:")


def test_an_unreadable_template_exits_1_with_its_code(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(H100_FILE.read_text().replace("  hotplug: true", "  hotplug: true\n  surprise: 1"))
    result = runner.invoke(app, ["template", "validate", "--json", str(bad)])
    assert result.exit_code == 1
    assert json.loads(result.output)["error"]["code"] == "template.unknown_field"
    result = runner.invoke(app, ["template", "validate", str(tmp_path / "missing.yaml")])
    assert result.exit_code == 1 and "template.not_found" in result.output


def test_show_prints_the_frozen_contract() -> None:
    result = runner.invoke(app, ["template", "show", str(H100_FILE)])
    assert result.exit_code == 0, result.output
    assert "cuda12-h100" in result.output and "535.309.01" in result.output and "min_driver_api" in result.output
    as_json = runner.invoke(app, ["template", "show", "--json", str(H100_FILE)])
    contract = FrozenContract.from_json(json.loads(as_json.output))
    assert contract.template_name == "cuda12-h100"


def test_the_installed_command_validates_a_file() -> None:
    exe = Path(sys.executable).parent / "cubeaccel"
    proc = subprocess.run(
        [str(exe), "template", "validate", "--json", str(EDU_FILE)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["template"]["name"] == "edu-demo"


def _validate_json(path: Path) -> tuple[int, dict[str, object]]:
    """`template validate --json` in a child with a deadline: the hostile inputs used to hang or exhaust memory."""
    proc = subprocess.run(
        [sys.executable, "-m", "cubeaccel", "template", "validate", str(path), "--json"],
        capture_output=True,
        timeout=30,
    )
    return proc.returncode, json.loads(proc.stdout)


def test_validate_refuses_special_files_without_reading_them(tmp_path: Path) -> None:
    """Issue 19 #10: /dev/zero read until MemoryError; /dev/urandom and a FIFO with no writer hung."""
    import os

    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    for path in (Path("/dev/zero"), Path("/dev/urandom"), fifo):
        rc, out = _validate_json(path)
        assert rc == 1 and out["error"]["code"] == "template.not_a_file", (path, out)  # type: ignore[index]


def test_validate_refuses_deep_nesting_with_a_code_not_a_traceback(tmp_path: Path) -> None:
    deep_json = tmp_path / "deep.json"
    deep_json.write_text('{"a": ' * 5000 + "1" + "}" * 5000)
    deep_yaml = tmp_path / "deep.yaml"
    deep_yaml.write_text("a: " + "[" * 5000 + "]" * 5000 + "\n")
    mid_yaml = tmp_path / "mid.yaml"
    mid_yaml.write_text("a: " + "[" * 40 + "]" * 40 + "\n")  # parses, but past the depth bound
    for path in (deep_json, deep_yaml, mid_yaml):
        rc, out = _validate_json(path)
        assert rc == 1 and out["error"]["code"] == "template.too_deep", (path, out)  # type: ignore[index]


def test_validate_refuses_a_yaml_alias_bomb(tmp_path: Path) -> None:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 9)]
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("\n".join(lines) + "\n")
    rc, out = _validate_json(bomb)
    assert rc == 1 and out["error"]["code"] == "template.too_large", out  # type: ignore[index]


def test_prepare_on_a_node_without_the_templates_image_fails_naming_the_image(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUBEACCEL_CACHE_DIR", str(tmp_path / "empty-cache"))
    r = runner.invoke(app, ["template", "prepare", str(H100_FILE), "--json"])
    assert r.exit_code == 1, r.output
    body = json.loads(r.output)
    assert body["error"]["code"] == "template.prepare_failed" and "image build" in body["error"]["message"]
    assert not (tmp_path / "empty-cache" / "templates").exists()  # nothing half-made
    r = runner.invoke(app, ["template", "prepare"])
    assert r.exit_code != 0 and "--memory-mib" in r.output


def test_cubelet_prepare_shapes_parse_memory_and_vcpus() -> None:
    from cubeaccel.cli.cubelet import _shapes
    from cubeaccel.cubelet.snapshots import Shape

    assert _shapes(["65536:8", "256"]) == [Shape(65536, 8), Shape(256, 1)]
    for bad in ("64G", "32", "256:x", "256:0"):
        with pytest.raises(typer.BadParameter):
            _shapes([bad])


def test_cubelet_prepare_templates_parse_file_and_vcpus_and_name_a_missing_file() -> None:
    from cubeaccel.cli.cubelet import _prepared_templates
    from cubeaccel.protocol.errors import CubeError

    (one, two) = _prepared_templates([str(H100_FILE), f"{H100_FILE}=4"])
    assert (one.template, one.vcpus, two.vcpus) == ("cuda12-h100", 1, 4)
    assert one.contract is not None and one.memory_mib == 65536
    with pytest.raises(typer.BadParameter):
        _prepared_templates([f"{H100_FILE}=0"])
    with pytest.raises(CubeError) as err:
        _prepared_templates(["/nonexistent/t.yaml"])
    assert err.value.code == "template.not_found"
