"""The guest report's PCI functions as typed records (protocol/reports.GuestPciDevice), read as the host's two checks
need them: the contract's check by vendor:device, the check without a contract by address too."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cubeaccel.model.contract import check_guest
from cubeaccel.model.guest_minimal import check_minimal
from cubeaccel.protocol.reports import GuestPciDevice, GuestReport
from tests.support.contract_builders import device, edu

ADDR = "0000:01:00.0"
AGENT_ENTRY = {"address": ADDR, "vendor_id": "1234", "device_id": "11e8", "class": "00ff00"}  # agent/probes' keys


def _not_visible(report: GuestReport) -> bool:
    """Whether the contract's check says the edu device is not in the guest (the report's other layers aside)."""
    return "compat.device_not_visible_in_guest" in [v.code for v in check_guest(edu(), report)]


def _report(*entries: object) -> GuestReport:
    """As the Cubelet reads it: from the JSON the guest sent."""
    doc = {"agent_version": 1, "kernel_release": "6.1.0", "pci_devices": list(entries)}
    return GuestReport.from_json(json.loads(json.dumps(doc)))


def test_the_agents_entries_read_as_records_and_write_the_same_bytes() -> None:
    entries = [AGENT_ENTRY, {"address": "0000:00:00.0", "vendor_id": "8086", "device_id": "29c0", "class": ""}]
    report = _report(*entries)
    assert report.pci_devices[0] == GuestPciDevice(ADDR, "1234", "11e8", "00ff00")
    assert json.dumps(report.to_json()["pci_devices"]) == json.dumps(entries)


def test_an_entry_without_an_address_counts_for_the_contract_check_only() -> None:
    """Deliberately lenient: vendor:device is what the contract asks; the minimal check also needs the address."""
    report = _report({"vendor_id": "1234", "device_id": "11e8"})
    assert report.pci_devices == (GuestPciDevice(None, "1234", "11e8"),)
    assert report.pci_devices[0].to_json() == {"vendor_id": "1234", "device_id": "11e8"}  # absent stays absent
    assert not _not_visible(report)
    edu_device = device(vendor_id=0x1234, device_id=0x11E8)
    (v,) = check_minimal([edu_device], {}, report)
    assert (v.code, v.found) == ("compat.device_not_visible_in_guest", "no PCI devices")
    assert check_minimal([edu_device], {edu_device.id: ADDR}, _report(AGENT_ENTRY)) == []


@pytest.mark.parametrize(("entry", "error"), [(5, TypeError), ("ab", ValueError), (None, TypeError)])
def test_an_entry_that_is_not_an_object_makes_the_report_malformed_as_it_did(entry: object, error: type) -> None:
    """The Cubelet answers guest.report_malformed with the exception's text: the same exception as the dict code."""
    with pytest.raises(error):
        _report(entry)


@pytest.mark.parametrize("ids", [{"vendor_id": 1234, "device_id": "11e8"}, {"vendor_id": "1234", "device_id": None}])
def test_an_id_that_is_not_text_reads_as_not_reported(ids: dict[str, Any]) -> None:
    """The dict code judged str(1234) as hex 0x1234: a number is not what sysfs says, so it shows no device."""
    assert _not_visible(_report({"address": ADDR, **ids})) and not _not_visible(_report(AGENT_ENTRY))


texts = st.text(max_size=8)
json_values = st.none() | st.booleans() | st.integers() | texts | st.lists(texts, max_size=2)
KEYS = ("address", "vendor_id", "device_id", "class")


@given(entry=st.dictionaries(st.sampled_from(KEYS) | texts, json_values, max_size=6))
def test_any_object_reads_as_a_record_and_its_text_fields_survive(entry: dict[str, Any]) -> None:
    record = GuestPciDevice.from_json(entry)
    assert record.to_json() == {k: v for k in KEYS if isinstance(v := entry.get(k), str)}
    assert GuestPciDevice.from_json(json.loads(json.dumps(record.to_json()))) == record


@given(values=st.tuples(texts, texts, texts, texts))
def test_an_entry_as_the_agent_writes_it_is_the_same_bytes_after_reading(values: tuple[str, ...]) -> None:
    entry = dict(zip(KEYS, values, strict=True))
    assert json.dumps(_report(entry).to_json()["pci_devices"]) == json.dumps([entry])
