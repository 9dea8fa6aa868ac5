"""Stage 0 for a sandbox: its own frozen copy of the contract, stable under later template edits."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cubeaccel.agent.spec import parse_spec
from cubeaccel.model.contract import CompatibilityContract, FrozenContract, canonical_json, freeze
from cubeaccel.model.template_spec import CudaSpec
from cubeaccel.protocol.errors import CubeError
from cubeaccel.wire.templates import parse_template
from tests.support.contract_builders import device, edu, h100, template


def roundtrip(contract: CompatibilityContract) -> CompatibilityContract:
    return FrozenContract.from_json(json.loads(json.dumps(contract.to_json())))


def test_a_frozen_contract_carries_name_version_and_the_digest_of_its_canonical_json() -> None:
    t = h100()
    c = freeze(t)
    assert (c.template_name, c.template_version) == ("cuda12-h100", "1")
    assert c.digest == "sha256:" + hashlib.sha256(canonical_json(t.to_json())).hexdigest()
    assert c.to_json()["template"] == {"name": "cuda12-h100", "version": "1", "digest": c.digest}


def test_the_digest_does_not_depend_on_key_order_or_the_file_format() -> None:
    doc = h100().to_json()
    reordered = json.loads(json.dumps(doc, sort_keys=True))
    reordered["spec"] = dict(reversed(list(reordered["spec"].items())))
    assert freeze(parse_template(reordered)).digest == freeze(h100()).digest


def test_json_round_trip_gives_back_an_equal_contract() -> None:
    for t in (h100(), edu()):
        c = freeze(t)
        assert roundtrip(c) == c


def test_editing_the_template_later_never_changes_a_frozen_contract() -> None:
    original = h100()
    frozen = freeze(original)
    stored = json.dumps(frozen.to_json())
    edited = dataclasses.replace(original, version="2", cuda=CudaSpec("12.6"), memory_mib=131072)
    assert freeze(edited).digest != frozen.digest
    assert frozen.template.cuda is not None and frozen.template.cuda.version == "12.2"
    assert frozen.memory_mib == 65536
    assert json.dumps(frozen.to_json()) == stored
    assert roundtrip(frozen) == frozen


def test_contract_accessors_the_cubelet_and_shim_read() -> None:
    c = freeze(h100())
    assert (c.memory_mib, c.pin_memory, c.hotplug, c.backend, c.accel_class) == (65536, True, True, "vfio", "gpu")


def test_a_tampered_stored_contract_is_refused() -> None:
    data = freeze(h100()).to_json()
    data["document"]["spec"]["cuda"]["version"] = "12.6"
    with pytest.raises(CubeError) as e:
        FrozenContract.from_json(data)
    assert e.value.code == "contract.digest_mismatch"


@pytest.mark.parametrize(
    ("mutate", "code"),
    [
        (lambda d: d.pop("document"), "contract.invalid_json"),
        (lambda d: d.update(contract_version=2), "contract.unsupported_version"),
        (lambda d: d.update(document=[]), "contract.invalid_json"),
        (lambda d: d["document"]["spec"].pop("memory"), "template.invalid_document"),
        (lambda d: d["document"].update(apiVersion="cubeaccel/v0"), "template.unsupported_api_version"),
    ],
)
def test_a_corrupt_stored_contract_fails_with_a_code(mutate: Any, code: str) -> None:
    data = freeze(h100()).to_json()
    mutate(data)
    with pytest.raises(CubeError) as e:
        FrozenContract.from_json(data)
    assert e.value.code == code


def test_guest_probes_are_plain_json_the_agent_understands() -> None:
    data = json.loads(json.dumps(freeze(h100()).to_json()))
    probes = data["guest_probes"]
    assert probes == {
        "kernel_release": "6.1.0-57-amd64",
        "modules": ["nvidia", "nvidia_uvm"],
        "kernel_driver": {"module": "nvidia", "version": "535.309.01"},
        "device_files": ["/dev/nvidiactl", "/dev/nvidia0", "/dev/nvidia-uvm"],
        "libraries": [
            {"name": "libcuda.so.1", "version": "535.309.01", "layer": "userspace_driver"},
            {"name": "libnvidia-ml.so.1", "version": "535.309.01", "layer": "userspace_driver"},
        ],
        "pci": [{"vendor_id": "10de", "device_id": "2321"}, {"vendor_id": "10de", "device_id": "2331"}],
        "cuda": {"version": "12.2", "min_driver_api": 12020},
        "load_modules": True,
        "persistence_mode": False,
    }
    spec = parse_spec(data)  # the stdlib-only agent reads the whole stored contract
    assert spec.guest_kernel == "6.1.0-57-amd64" and spec.min_driver_api == 12020
    assert [lib.name for lib in spec.libraries] == ["libcuda.so.1", "libnvidia-ml.so.1"]


def test_a_template_asking_for_persistence_mode_carries_it_to_the_agent() -> None:
    t = template(spec__guest__init={"persistence_mode": True, "load_modules": False})
    data = json.loads(json.dumps(freeze(t).to_json()))
    assert (data["guest_probes"]["persistence_mode"], data["guest_probes"]["load_modules"]) == (True, False)
    spec = parse_spec(data)
    assert spec.persistence_mode and spec.wants_nvml and spec.load_modules is False
    assert not parse_spec(freeze(h100()).to_json()).persistence_mode  # only when the contract asks


def test_default_guest_init_leaves_the_digest_of_older_contracts_unchanged() -> None:
    explicit = template(spec__guest__init={"load_modules": True, "persistence_mode": False})
    assert "init" not in freeze(h100()).to_json()["document"]["spec"]["guest"]
    assert freeze(explicit).digest == freeze(h100()).digest


def test_guest_probes_name_the_reserved_device_when_given() -> None:
    c = freeze(h100())
    reserved = device(0x10DE, 0x2330, address="0000:9b:00.0")
    assert c.guest_probes([reserved]).to_json()["pci"] == [{"vendor_id": "10de", "device_id": "2330"}]


def test_edu_guest_probes_only_expect_the_pci_device() -> None:
    probes = freeze(edu()).guest_probes().to_json()
    assert probes["pci"] == [{"vendor_id": "1234", "device_id": "11e8"}]
    assert probes["modules"] == [] and probes["libraries"] == [] and probes["cuda"] is None


@settings(max_examples=60, deadline=None)
@given(
    memory=st.integers(min_value=64, max_value=1 << 20),
    version=st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,20}", fullmatch=True),
    description=st.text(max_size=40),
)
def test_any_valid_template_round_trips_through_its_frozen_json(memory: int, version: str, description: str) -> None:
    t = dataclasses.replace(h100(), memory_mib=memory, version=version, description=description)
    c = freeze(t)
    assert roundtrip(c) == c
