"""Reading template files: YAML and JSON, unknown fields rejected, every schema error a stable code."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from cubeaccel.protocol.errors import CubeError
from cubeaccel.wire.templates import MAX_TEMPLATE_BYTES, load_template, loads_template, parse_template
from tests.support.contract_builders import EDU_FILE, H100_FILE, example_doc, h100, set_path


def code_of(fn: Any, *args: Any) -> CubeError:
    with pytest.raises(CubeError) as e:
        fn(*args)
    return e.value


def test_the_h100_example_loads_with_its_values() -> None:
    t = load_template(H100_FILE)
    assert (t.name, t.version, t.backend, t.accel_class) == ("cuda12-h100", "1", "vfio", "gpu")
    assert t.kernel_driver is not None and t.kernel_driver.version == "535.309.01"
    assert t.cuda is not None and (t.cuda.version, t.cuda.compatibility) == ("12.2", "toolkit")
    assert (t.memory_mib, t.pin_memory, t.hotplug) == (65536, True, True)
    assert [d.vendor_device for d in t.devices] == ["10de:2331", "10de:2321"]
    assert t.devices[0].labels == {"model": "H100-PCIe-80GB", "architecture": "hopper"}


def test_guest_init_defaults_to_loading_modules_without_persistence_mode() -> None:
    t = load_template(H100_FILE)
    assert (t.init.load_modules, t.init.persistence_mode) == (True, False)


def test_guest_init_steps_are_read_and_kept_in_the_document() -> None:
    doc = set_path(example_doc(), "spec.guest.init", {"persistence_mode": True})
    t = parse_template(doc)
    assert (t.init.load_modules, t.init.persistence_mode) == (True, True)
    assert t.to_json()["spec"]["guest"]["init"] == {"load_modules": True, "persistence_mode": True}


@pytest.mark.parametrize(
    ("init", "code", "field"),
    [
        ({"persistence_mode": "yes"}, "template.invalid_field", "spec.guest.init.persistence_mode"),
        ({"persistance_mode": True}, "template.unknown_field", "spec.guest.init.persistance_mode"),
    ],
)
def test_guest_init_fields_are_strict(init: dict[str, Any], code: str, field: str) -> None:
    e = code_of(parse_template, set_path(example_doc(), "spec.guest.init", init))
    assert (e.code, e.details["errors"][0]["field"]) == (code, field)


def test_the_edu_example_has_no_driver_and_no_cuda() -> None:
    t = load_template(EDU_FILE)
    assert (t.backend, t.kernel_driver, t.userspace_driver, t.cuda) == ("emulated", None, None, None)
    assert [d.vendor_device for d in t.devices] == ["1234:11e8"]
    assert t.guest_kernel.version == t.modules_img.kernel_version == "6.1.0-57-amd64"


def test_json_and_yaml_files_of_the_same_document_give_the_same_template(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    path.write_text(json.dumps(example_doc()))
    assert load_template(path) == load_template(H100_FILE)


def test_to_json_is_a_valid_template_document() -> None:
    t = h100()
    assert parse_template(t.to_json()) == t
    assert parse_template(yaml.safe_load(yaml.safe_dump(t.to_json()))) == t


@pytest.mark.parametrize(
    ("path", "value", "code", "field"),
    [
        ("spec.cuda.verison", "12.4", "template.unknown_field", "spec.cuda.verison"),
        ("spec.colour", "red", "template.unknown_field", "spec.colour"),
        ("spec.accelerator.devices.0.vendor", "10de", "template.unknown_field", "spec.accelerator.devices.0.vendor"),
        ("spec.memory.size_mib", "64G", "template.invalid_field", "spec.memory.size_mib"),
        ("spec.memory.pinned", "yes", "template.invalid_field", "spec.memory.pinned"),
        ("spec.cuda.version", 12.4, "template.invalid_field", "spec.cuda.version"),
        ("spec.cuda.compatibility", "forward", "template.invalid_field", "spec.cuda.compatibility"),
        (
            "spec.accelerator.devices.0.vendor_id",
            "nvidia",
            "template.invalid_field",
            "spec.accelerator.devices.0.vendor_id",
        ),
    ],
)
def test_schema_errors_carry_a_stable_code_and_the_field(path: str, value: Any, code: str, field: str) -> None:
    e = code_of(parse_template, set_path(example_doc(), path, value))
    assert e.code == code
    assert e.layer == "template" and e.status == 422
    assert e.details["errors"][0]["field"] == field


def test_a_missing_field_is_named() -> None:
    doc = example_doc()
    del doc["spec"]["hotplug"]
    e = code_of(parse_template, doc)
    assert (e.code, e.details["errors"][0]["field"]) == ("template.missing_field", "spec.hotplug")


def test_a_typo_reports_the_unknown_field_first() -> None:
    doc = example_doc()
    doc["spec"]["hotplugg"] = doc["spec"].pop("hotplug")
    e = code_of(parse_template, doc)
    assert e.code == "template.unknown_field" and "spec.hotplugg" in e.message
    assert {x["code"] for x in e.details["errors"]} == {"template.unknown_field", "template.missing_field"}


def test_an_unquoted_version_gets_a_hint_about_quoting() -> None:
    e = code_of(loads_template, H100_FILE.read_text().replace('version: "12.2"', "version: 12.10"))
    assert e.code == "template.invalid_field" and "quotes" in e.message


@pytest.mark.parametrize(
    ("text", "code"),
    [
        ("apiVersion: cubeaccel/v1\nkind: [unclosed", "template.invalid_yaml"),
        ('{"apiVersion": "cubeaccel/v1",', "template.invalid_json"),
        ("- just\n- a list\n", "template.not_a_mapping"),
        ("", "template.not_a_mapping"),
        ("apiVersion: cubeaccel/v2\nkind: AcceleratorTemplate\n", "template.unsupported_api_version"),
        ("apiVersion: cubeaccel/v1\nkind: Template\n", "template.wrong_kind"),
        ("!!python/object/apply:os.system ['true']", "template.invalid_yaml"),
    ],
)
def test_unparseable_text_fails_with_a_code(text: str, code: str) -> None:
    assert code_of(loads_template, text).code == code


def test_file_errors(tmp_path: Path) -> None:
    assert code_of(load_template, tmp_path / "nope.yaml").code == "template.not_found"
    assert code_of(load_template, tmp_path).code == "template.unreadable"
    (tmp_path / "latin1.yaml").write_bytes(b"name: caf\xe9\n")
    assert code_of(load_template, tmp_path / "latin1.yaml").code == "template.invalid_encoding"
    (tmp_path / "big.yaml").write_text("#" * (MAX_TEMPLATE_BYTES + 10))
    assert code_of(load_template, tmp_path / "big.yaml").code == "template.too_large"


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=200))
def test_arbitrary_text_never_crashes_the_loader(text: str) -> None:
    try:
        loads_template(text)
    except CubeError as e:
        assert e.code.startswith("template.")


@settings(max_examples=100, deadline=None)
@given(
    path=st.sampled_from(
        ["metadata", "spec", "spec.accelerator", "spec.guest.kernel", "spec.memory", "spec.probes", "spec.driver"]
    ),
    value=st.one_of(st.none(), st.integers(), st.text(max_size=10), st.lists(st.integers(), max_size=2)),
)
def test_replacing_a_section_with_junk_fails_with_a_template_code(path: str, value: Any) -> None:
    try:
        parse_template(set_path(example_doc(), path, value))
    except CubeError as e:
        assert e.code.startswith("template.")
