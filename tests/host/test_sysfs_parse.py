"""Parsers of sysfs text: exact on what the kernel prints, None (never a guess) on anything else."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cubeaccel.host.pci.sysfs_parse import (
    parse_aer_total,
    parse_config_serial,
    parse_config_vendor,
    parse_driver_override,
    parse_hex,
    parse_reset_method,
    valid_driver_name,
)
from cubeaccel.model.bars import parse_resource, parse_resource_lines
from cubeaccel.protocol.errors import CubeError


@given(st.integers(0, 0xFFFFFFFF))
def test_hex_round_trips_what_the_kernel_prints(value: int) -> None:
    assert parse_hex(f"0x{value:04x}\n") == value


@given(st.text(max_size=20))
def test_hex_never_raises(text: str) -> None:
    result = parse_hex(text)
    assert result is None or 0 <= result <= 0xFFFFFFFF


@given(st.lists(st.tuples(st.integers(0, 2**48), st.integers(0, 2**40)), min_size=6, max_size=13))
def test_resource_sizes_are_end_minus_start_plus_one(bars: list[tuple[int, int]]) -> None:
    text = "".join(f"0x{s:016x} 0x{s + n - 1 if n else 0:016x} 0x0000000000040200\n" for s, n in bars)
    assert tuple(line.size for line in parse_resource_lines(text)) == tuple(n if n > 1 else 0 for _, n in bars[:6])
    assert tuple(b.size for b in parse_resource(text)) == tuple(n for _, n in bars[:6] if n > 1)


@given(st.text(max_size=200))
def test_resource_never_raises(text: str) -> None:
    assert all(b.size > 0 for b in parse_resource(text))


def test_driver_override_null_means_none() -> None:
    assert parse_driver_override("(null)\n") is None
    assert parse_driver_override("vfio-pci\n") == "vfio-pci"
    assert parse_driver_override(None) is None


def test_reset_method_and_aer() -> None:
    assert parse_reset_method("flr bus\n") == ("flr", "bus")
    assert parse_reset_method("") == ()
    text = "Undefined 0\nSurpriseDown 1\nTOTAL_ERR_FATAL 3\n"
    assert parse_aer_total(text, "TOTAL_ERR_FATAL") == 3
    assert parse_aer_total(text, "TOTAL_ERR_NONFATAL") is None


@given(st.binary(max_size=600))
def test_config_parsers_never_raise(data: bytes) -> None:
    assert 0 <= parse_config_vendor(data) <= 0xFFFF
    serial = parse_config_serial(data)
    assert serial is None or len(serial) == 23


def test_config_serial_follows_the_extended_capability_chain() -> None:
    data = bytearray(4096)
    data[0x100:0x104] = (0x0001 | (1 << 16) | (0x148 << 20)).to_bytes(4, "little")  # AER, next at 0x148
    data[0x148:0x14C] = (0x0003 | (1 << 16)).to_bytes(4, "little")  # DSN, last
    data[0x14C:0x154] = (0xA1B2C3D4E5F60718).to_bytes(8, "little")
    assert parse_config_serial(bytes(data)) == "a1-b2-c3-d4-e5-f6-07-18"
    assert parse_config_serial(bytes(data[:64])) is None  # what an unprivileged reader gets


@pytest.mark.parametrize(
    "name", ["", ".", "..", "../nvidia", "vfio-pci/../../x", "vfio-pci\n", "a b", "x" * 65, None, 3]
)
def test_driver_names_that_could_escape_are_refused(name: object) -> None:
    with pytest.raises(CubeError) as e:
        valid_driver_name(name)
    assert e.value.code == "host.invalid_driver_name"


@given(st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}", fullmatch=True))
def test_driver_names_never_contain_a_separator(name: str) -> None:
    if name not in (".", ".."):
        assert "/" not in valid_driver_name(name)
