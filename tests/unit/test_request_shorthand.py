"""The accelerator request parser: shorthand ("H100:2") and the long form with alternatives."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cubeaccel.model.request import (
    MAX_COUNT,
    AcceleratorChoice,
    parse_accelerators,
    parse_shorthand,
)
from cubeaccel.protocol.errors import CubeError

MODEL = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,20}", fullmatch=True).filter(
    lambda s: s.lower() not in ("gpu", "accelerator")
)


@given(MODEL, st.integers(1, MAX_COUNT))
def test_shorthand_with_a_count_names_a_gpu_model_and_count(model: str, count: int) -> None:
    req = parse_shorthand(f"{model}:{count}")
    assert req.primary == AcceleratorChoice("gpu", count, model=model)
    assert req.to_json() == {"class": "gpu", "count": count, "model": model}


@given(MODEL)
def test_shorthand_without_count_means_one(model: str) -> None:
    assert parse_shorthand(model).primary.count == 1


@pytest.mark.parametrize(("text", "cls"), [("gpu:3", "gpu"), ("GPU", "gpu"), ("accelerator:2", "accelerator")])
def test_shorthand_naming_a_class_asks_for_any_device_of_it(text: str, cls: str) -> None:
    choice = parse_shorthand(text).primary
    assert choice.accel_class == cls and choice.model is None


@pytest.mark.parametrize("count", [0, MAX_COUNT + 1, 10**6, 10**11])
def test_shorthand_count_out_of_range_is_invalid_count(count: int) -> None:
    with pytest.raises(CubeError) as e:
        parse_shorthand(f"H100:{count}")
    assert e.value.code == "request.invalid_count" and e.value.status == 422


@given(st.text(max_size=40) | st.integers() | st.none() | st.lists(st.integers(), max_size=2))
def test_any_shorthand_input_parses_or_is_refused_with_a_request_code(text: object) -> None:
    try:
        req = parse_shorthand(text)
    except CubeError as e:
        assert e.code in ("request.invalid_shorthand", "request.invalid_count") and e.status == 422
    else:
        assert 1 <= req.primary.count <= MAX_COUNT


@pytest.mark.parametrize("text", ["", ":2", "H100:", "H100:two", "H 100", "H100:2:3", "-H100", "H100:-1"])
def test_malformed_shorthand_is_refused(text: str) -> None:
    with pytest.raises(CubeError) as e:
        parse_shorthand(text)
    assert e.value.code == "request.invalid_shorthand"


def test_model_matches_exactly_or_as_a_dash_prefix_case_insensitively() -> None:
    c = AcceleratorChoice("gpu", 1, model="h100")
    assert c.model_matches("H100-PCIe-80GB") and c.model_matches("H100")
    assert not c.model_matches("H1000") and not c.model_matches("H200-SXM-141GB")


def test_long_form_keeps_alternatives_in_order() -> None:
    req = parse_accelerators(
        [
            {
                "class": "gpu",
                "count": 2,
                "selector": "device.model == 'x'",
                "alternatives": [{"class": "gpu", "count": 1, "model": "A100"}, {"class": "accelerator"}],
            }
        ]
    )
    assert [c.accel_class for c in req.choices] == ["gpu", "gpu", "accelerator"]
    assert req.choices[1].model == "A100" and req.choices[2].count == 1
    assert req.to_json()["alternatives"][0] == {"class": "gpu", "count": 1, "model": "A100"}


@pytest.mark.parametrize(
    ("items", "code"),
    [
        ([], "request.invalid_accelerator"),
        ({"class": "gpu"}, "request.invalid_accelerator"),
        ([{"class": "tpu"}], "request.unknown_class"),
        ([{"class": "gpu", "count": 0}], "request.invalid_count"),
        ([{"class": "gpu", "count": True}], "request.invalid_count"),
        ([{"class": "gpu", "count": "2"}], "request.invalid_count"),
        ([{"class": "gpu", "colour": "red"}], "api.unknown_field"),
        ([{"class": "gpu"}, {"class": "gpu"}], "request.multiple_accelerator_kinds"),
        ([{"class": "gpu", "selector": ""}], "selector.invalid"),
        ([{"class": "gpu", "alternatives": [{"class": "gpu", "alternatives": []}]}], "api.unknown_field"),
        ([{"class": "gpu", "alternatives": [{}] * 9}], "request.invalid_alternatives"),
        ([{"class": "gpu", "model": "H100:2"}], "request.invalid_model"),
    ],
)
def test_long_form_errors_have_codes(items: object, code: str) -> None:
    with pytest.raises(CubeError) as e:
        parse_accelerators(items)
    assert e.value.code == code and e.value.status == 422
