"""CEL selectors: compile errors are 4xx at submission; runtime errors mean no match; memoised per label set."""

from __future__ import annotations

import pytest

from cubeaccel.master.selector import Selector, compile_selector
from cubeaccel.protocol.errors import CubeError

H100 = {"model": "H100-PCIe-80GB", "memory_gib": "80", "vendor": "nvidia", "class": "gpu"}
T4 = {"model": "T4-16GB", "memory_gib": "16", "vendor": "nvidia", "class": "gpu"}


def test_selector_matches_on_device_labels() -> None:
    s = Selector('device.model.startsWith("H100") && int(device.memory_gib) >= 80')
    assert s.matches(H100) and not s.matches(T4)


@pytest.mark.parametrize("expr", ["device.model ==", "1 + 'a'", "device.model.noSuchFunction()", "(("])
def test_malformed_cel_is_a_compile_error(expr: str) -> None:
    with pytest.raises(CubeError) as e:
        Selector(expr)
    assert e.value.code == "selector.compile_error" and e.value.status == 422
    assert e.value.details["selector"] == expr


@pytest.mark.parametrize("expr", ["42", "device.model", "'yes'"])
def test_non_boolean_selector_is_refused(expr: str) -> None:
    with pytest.raises(CubeError) as e:
        Selector(expr)
    assert e.value.code == "selector.not_boolean"


def test_missing_label_or_bad_conversion_means_no_match_not_a_crash() -> None:
    assert not Selector("device.numa == '0'").matches(H100)
    assert not Selector("int(device.model) > 3").matches(H100)


def test_each_distinct_label_set_is_evaluated_once() -> None:
    s = Selector("device.vendor == 'nvidia'")
    for _ in range(100):
        assert s.matches(H100) and s.matches(T4)
    assert s.evaluations == 2


def test_compiled_selectors_are_shared_by_text() -> None:
    assert compile_selector("device.vendor == 'amd'") is compile_selector("device.vendor == 'amd'")
