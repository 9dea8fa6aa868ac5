"""Version parsing and ordering: driver 550.54.14, CUDA 12.4, kernel 6.1.0-27-cloud-amd64; garbage → CubeError."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cubeaccel.model.versions import CudaVersion, DriverVersion, KernelVersion
from cubeaccel.protocol.errors import CubeError

drivers = st.builds(
    lambda b, m, p: f"{b}.{m}" + ("" if p is None else f".{p:02d}"),
    st.integers(10, 9999),
    st.integers(0, 999),
    st.none() | st.integers(0, 99),
)
cudas = st.builds(
    lambda a, b, u: f"{a}.{b}" + (f".{u}" if u else ""), st.integers(0, 999), st.integers(0, 999), st.integers(0, 999)
)
flavours = st.sampled_from(["", "-amd64", "-cloud-amd64", "-generic", "-aws", "-rt-amd64", "+debug"])
kernels = st.builds(
    lambda a, b, c, abi, fl: f"{a}.{b}.{c}" + ("" if abi is None else f"-{abi}") + fl,
    st.integers(2, 999),
    st.integers(0, 999),
    st.integers(0, 9999),
    st.none() | st.integers(0, 999999),
    flavours,
)
garbage = st.one_of(
    st.text(max_size=80),
    st.text(alphabet="0123456789.-", max_size=30),
    st.binary(max_size=20),
    st.integers(),
    st.floats(allow_nan=True),
    st.none(),
    st.lists(st.integers(), max_size=3),
    st.booleans(),
)
PARSERS: list[tuple[Any, str, str]] = [
    (DriverVersion.parse, "version.invalid_driver", "kernel_driver"),
    (CudaVersion.parse, "version.invalid_cuda", "cuda_runtime"),
    (CudaVersion.from_driver_api, "version.invalid_cuda", "cuda_runtime"),
    (KernelVersion.parse, "version.invalid_kernel", "guest_kernel"),
]


def test_the_three_reference_versions_parse() -> None:
    assert DriverVersion.parse("550.54.14") == DriverVersion(550, 54, 14)
    assert CudaVersion.parse("12.4") == CudaVersion(12, 4, 0)
    k = KernelVersion.parse("6.1.0-27-cloud-amd64")
    assert (k.major, k.minor, k.patch, k.abi, k.flavour) == (6, 1, 0, 27, "cloud-amd64")
    assert str(k) == "6.1.0-27-cloud-amd64"


def test_numeric_not_lexical_ordering() -> None:
    assert DriverVersion.parse("550.100.01") > DriverVersion.parse("550.54.14")
    assert DriverVersion.parse("570.26") < DriverVersion.parse("570.124.06")
    assert DriverVersion.parse("570.26") <= DriverVersion.parse("570.26")
    assert CudaVersion.parse("12.10") > CudaVersion.parse("12.9")
    assert CudaVersion.parse("12.4.1") > CudaVersion.parse("12.4")
    assert KernelVersion.parse("6.1.0-100-amd64") > KernelVersion.parse("6.1.0-27-amd64")
    assert KernelVersion.parse("5.15.0-105-generic") < KernelVersion.parse("6.1.0-27-cloud-amd64")


def test_cuda_driver_api_integers() -> None:
    assert CudaVersion.from_driver_api(12040) == CudaVersion(12, 4)
    assert CudaVersion.from_driver_api(11080).driver_api == 11080
    assert CudaVersion.from_driver_api("12.4") == CudaVersion(12, 4)


@pytest.mark.parametrize(
    ("parser", "text"),
    [
        (DriverVersion.parse, "550"),
        (DriverVersion.parse, "550.54.14.2"),
        (DriverVersion.parse, "550.54.4"),  # NVIDIA always prints two patch digits
        (DriverVersion.parse, " 550.54.14"),
        (DriverVersion.parse, "r550"),
        (DriverVersion.parse, "5\uff150.54.14"),  # a full-width digit is not a digit here
        (CudaVersion.parse, "12"),
        (CudaVersion.parse, "v12.4"),
        (CudaVersion.from_driver_api, 12),
        (CudaVersion.from_driver_api, True),
        (KernelVersion.parse, "linux-6.1"),
        (KernelVersion.parse, "6"),
        (KernelVersion.parse, "6.1.0-27-cloud-amd64\n"),
        (KernelVersion.parse, "6.1.0-27/../../etc"),
        (DriverVersion.parse, "5" * 200),
    ],
)
def test_known_garbage_is_refused_with_a_code(parser: Any, text: Any) -> None:
    with pytest.raises(CubeError) as e:
        parser(text)
    assert e.value.code.startswith("version.invalid_") and e.value.status == 422


@settings(max_examples=300)
@given(text=drivers)
def test_driver_versions_round_trip(text: str) -> None:
    assert str(DriverVersion.parse(text)) == text


@settings(max_examples=300)
@given(a=drivers, b=drivers)
def test_driver_order_is_numeric_order(a: str, b: str) -> None:
    da, db = DriverVersion.parse(a), DriverVersion.parse(b)

    def key(s: str) -> tuple[int, ...]:
        parts = [int(x) for x in s.split(".")]
        return tuple(parts + [0] * (3 - len(parts)))

    assert (da < db) == (key(a) < key(b))
    assert (da >= db) == (key(a) >= key(b))
    assert da.at_least(db) == (key(a) >= key(b))


@settings(max_examples=300)
@given(text=cudas)
def test_cuda_versions_round_trip_and_order(text: str) -> None:
    v = CudaVersion.parse(text)
    assert CudaVersion.parse(str(v)) == v
    assert (v.major, v.minor) == tuple(int(x) for x in text.split(".")[:2])
    if v.update == 0 and v.major >= 1 and v.minor < 100:
        assert CudaVersion.from_driver_api(v.driver_api) == v


@settings(max_examples=300)
@given(a=kernels, b=kernels)
def test_kernel_releases_parse_and_order_by_numbers_first(a: str, b: str) -> None:
    ka, kb = KernelVersion.parse(a), KernelVersion.parse(b)
    assert str(ka) == a
    if (ka.major, ka.minor, ka.patch) != (kb.major, kb.minor, kb.patch):
        assert (ka < kb) == ((ka.major, ka.minor, ka.patch) < (kb.major, kb.minor, kb.patch))
    assert (ka == kb) == (a == b)
    assert (ka <= kb) and (kb <= ka) if a == b else (ka < kb) != (kb < ka)


@settings(max_examples=500)
@given(value=garbage)
def test_garbage_never_crashes_a_parser(value: object) -> None:
    for parser, code, layer in PARSERS:
        try:
            parser(value)
        except CubeError as e:
            assert e.code == code
            assert e.layer == layer
            assert len(e.message) < 300  # a clear, bounded message even for huge input
