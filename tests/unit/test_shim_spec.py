"""The shim's spec file: every field validated with a stable code before any VMM starts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cubeaccel.cubelet.lifecycle import ReservationRequest
from cubeaccel.model.contract import freeze
from cubeaccel.model.lifecycle_ops import UNSUPPORTED, refuse
from cubeaccel.model.reservation_params import parse_contract
from cubeaccel.protocol.errors import CubeError
from cubeaccel.wire.shim_spec import MAX_DEVICES, DeviceSpec, ShimSpec, load_spec, parse_spec
from cubeaccel.wire.templates import load_template
from tests.support.cubelet_harness import Node

EXAMPLES = Path(__file__).resolve().parents[2] / "src" / "cubeaccel" / "examples" / "templates"


def _spec(**over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "sandbox_id": "sb-1",
        "devices": [
            {
                "device_id": "emulated-0000:e0:00.0",
                "driver": "edu",
                "properties": {},
                "vendor_id": "1234",
                "device_id_hex": "11e8",
            }
        ],
        "memory_mib": 256,
        "vcpus": 1,
        "pin_memory": True,
        "contract": None,
        "image_manifest": "/cache/images/k/manifest.json",
        "start": "template",
        "state_dir": "/run/sb-1",
        "report": {"file": "/run/sb-1/reports.jsonl"},
        "detach_timeout_s": 5,
    }
    base.update(over)
    return base


def _code_field(data: object) -> tuple[str, str]:
    with pytest.raises(CubeError) as e:
        parse_spec(data)
    return e.value.code, e.value.details.get("field", "")


def test_a_cubelet_spec_parses_into_typed_fields(tmp_path: Path) -> None:
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(_spec(report={"socket": "/run/cubelet.sock"})))
    spec = load_spec(path)
    assert spec.devices[0].vendor_device == "1234:11e8"
    assert spec.report_socket == Path("/run/cubelet.sock") and spec.report_file is None
    assert spec.detach_timeout_s == 5.0 and spec.start == "template"


@pytest.mark.parametrize(
    ("over", "field"),
    [
        ({"sandbox_id": "../etc"}, "sandbox_id"),
        ({"sandbox_id": "a b"}, "sandbox_id"),
        ({"memory_mib": 0}, "memory_mib"),
        ({"memory_mib": True}, "memory_mib"),
        ({"vcpus": 0}, "vcpus"),
        ({"start": "warm"}, "start"),
        ({"state_dir": "relative/dir"}, "state_dir"),
        ({"report": {"socket": "/a", "file": "/b"}}, "report"),
        ({"report": {"http": "x"}}, "report"),
        ({"detach_timeout_s": -1}, "detach_timeout_s"),
        ({"pin_memory": "yes"}, "pin_memory"),
        ({"contract": []}, "contract"),
        (
            {
                "devices": [
                    {
                        "device_id": "d",
                        "driver": "edu",
                        "properties": {"bus": "pcie.0"},
                        "vendor_id": "1234",
                        "device_id_hex": "11e8",
                    }
                ]
            },
            "devices[0].properties",
        ),
        (
            {
                "devices": [
                    {
                        "device_id": "d",
                        "driver": "edu,x=1",
                        "properties": {},
                        "vendor_id": "1234",
                        "device_id_hex": "11e8",
                    }
                ]
            },
            "devices[0].driver",
        ),
        (
            {
                "devices": [
                    {"device_id": "d", "driver": "edu", "properties": {}, "vendor_id": "12345", "device_id_hex": "11e8"}
                ]
            },
            "devices[0].vendor_id",
        ),
        (
            {
                "devices": [
                    {"device_id": "d", "driver": "edu", "properties": {}, "vendor_id": "1234", "device_id_hex": "11e8"}
                ]
                * 2
            },
            "devices",
        ),
        ({"devices": [{}] * (MAX_DEVICES + 1)}, "devices"),
    ],
)
def test_invalid_fields_are_named(over: dict[str, Any], field: str) -> None:
    assert _code_field(_spec(**over)) == ("shim.invalid_spec", field)


@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=8),
        lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3),
        max_leaves=10,
    )
)
def test_arbitrary_json_never_crashes_the_parser(data: object) -> None:
    try:
        parse_spec(data)
    except CubeError as e:
        assert e.code == "shim.invalid_spec"


@given(st.sampled_from(sorted(UNSUPPORTED)))
def test_lifecycle_features_are_refused_for_accelerator_sandboxes(op: str) -> None:
    e = refuse(op, "sb-1")
    assert e.code == "lifecycle.unsupported_for_accelerator" and e.status == 409
    assert e.details["operation"] == op


def test_the_spec_cubelet_builds_round_trips_through_the_file_the_shim_reads(tmp_path: Path) -> None:
    built = ShimSpec(
        sandbox_id="sb-1",
        devices=(
            DeviceSpec(
                device_id="vfio-0000:e0:00.0",
                address="0000:e0:00.0",
                driver="vfio-pci",
                properties={"host": "0000:e0:00.0"},
                vendor_id=0x10DE,
                device_id_hex=0x2330,
            ),
        ),
        memory_mib=512,
        vcpus=2,
        pin_memory=True,
        contract=parse_contract(freeze(load_template(EXAMPLES / "edu-demo.yaml"))),
        start_id="abc-1",
        image_digest="sha256:" + "a" * 64,
        state_dir=Path("/run/sb-1"),
        report={"socket": "/run/cubelet.sock"},
    )
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(built.to_json()))
    written = json.loads(path.read_text())
    assert written["v"] == 1 and written["devices"][0]["vendor_id"] == "10de"  # as Cubelet always wrote it
    assert load_spec(path) == built
    assert load_spec(path).devices[0].vendor_device == "10de:2330"


def test_a_spec_without_a_version_is_version_1_and_another_version_is_refused() -> None:
    assert parse_spec(_spec()).v == 1
    with pytest.raises(CubeError) as e:
        parse_spec(_spec(v=2))
    assert e.value.code == "shim.invalid_spec" and e.value.details["field"] == "v"
    assert "unsupported ShimSpec version 2" in e.value.message


@pytest.mark.parametrize(
    ("over", "field"),
    [({"typo_field": 1}, "typo_field"), ({"devices": [{**_spec()["devices"][0], "extra": "x"}]}, "devices[0].extra")],
)
def test_unknown_fields_are_refused_by_name(over: dict[str, Any], field: str) -> None:
    assert _code_field(_spec(**over)) == ("shim.invalid_spec", field)


def test_the_shim_refuses_a_spec_that_does_not_say_where_it_lives_or_reports() -> None:
    for missing in ("state_dir", "report"):
        data = _spec()
        del data[missing]
        assert _code_field(data) == ("shim.invalid_spec", missing)


def test_the_spec_file_carries_the_contract_as_the_journal_holds_it_byte_for_byte(tmp_path: Path) -> None:
    """The file the shim reads is what the dict-typed spec wrote: the contract as read back from the journal
    (keys sorted by the store), not a re-derivation; the shim parses it and cube-agent gets those bytes."""
    contract = freeze(load_template(EXAMPLES / "cuda12-h100.yaml"))
    node = Node.create(tmp_path, "h100x1")
    node.cubelet.reserve("sb", ReservationRequest(count=1, contract=contract))
    spec = node.cubelet._spec("sb")
    written = json.dumps(spec.to_json())
    as_journal_held = json.loads(json.dumps(contract.to_json(), sort_keys=True))
    assert written == json.dumps({**spec.to_json(), "contract": as_journal_held})  # the old spec's bytes
    read = parse_spec({**json.loads(written), "state_dir": "/run/sb", "report": {"file": "/run/sb/r"}})
    assert read.contract is not None and read.contract.digest == contract.digest
    assert json.dumps(read.contract.to_json()) == json.dumps(as_journal_held)  # what the agent is sent
    assert read.boot_image_digest == spec.image_digest == contract.template.guest_image_digest


def test_a_tampered_contract_in_the_spec_is_refused_before_any_vm() -> None:
    contract = freeze(load_template(EXAMPLES / "edu-demo.yaml")).to_json()
    contract["document"]["spec"]["memory"]["size_mib"] = 1 << 20
    assert _code_field(_spec(contract=contract)) == ("shim.invalid_spec", "contract")
    assert _code_field(_spec(contract={"guest": {"image": {"digest": "sha256:" + "0" * 64}}})) == (
        "shim.invalid_spec",
        "contract",
    )
