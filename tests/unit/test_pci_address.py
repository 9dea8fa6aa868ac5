from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cubeaccel.model.device import AcceleratorClass, PciAddress, parse_hex_id
from cubeaccel.protocol.errors import CubeError


@given(st.integers(0, 0xFFFF), st.integers(0, 0xFF), st.integers(0, 0x1F), st.integers(0, 7))
def test_round_trip(domain: int, bus: int, slot: int, fn: int) -> None:
    a = PciAddress(domain, bus, slot, fn)
    assert PciAddress.parse(str(a)) == a
    assert PciAddress.parse(str(a).upper()) == a


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "0000:3b:00",
        "0000:3b:00.8",
        "0000:3b:20.0",
        "000:3b:00.0",
        "0000:3b:00.0\n",
        " 0000:3b:00.0",
        "../../../etc",
        "0000:3b:00.0/../x",
        "0000:3b:0g.0",
        "00000:3b:00.0",
        "0000:3b:00.0 ",
        "0000-3b-00.0",
    ],
)
def test_rejects_anything_but_a_strict_bdf(bad: str) -> None:
    with pytest.raises(CubeError) as err:
        PciAddress.parse(bad)
    assert err.value.code == "device.invalid_address"


@given(st.text(max_size=40))
def test_garbage_never_crashes(text: str) -> None:
    try:
        a = PciAddress.parse(text)
    except CubeError as e:
        assert e.code == "device.invalid_address"
    else:
        assert str(a) == text.lower()


def test_non_string_input_is_rejected() -> None:
    with pytest.raises(CubeError):
        PciAddress.parse(1234)


def test_hex_ids_and_classes() -> None:
    assert parse_hex_id("0x10de") == 0x10DE
    assert parse_hex_id("10DE") == 0x10DE
    with pytest.raises(CubeError):
        parse_hex_id("10de0")
    assert AcceleratorClass.from_pci_class(0x030200) is AcceleratorClass.GPU
    assert AcceleratorClass.from_pci_class(0x120000) is AcceleratorClass.ACCELERATOR
    assert AcceleratorClass.from_pci_class(0x020000) is None
