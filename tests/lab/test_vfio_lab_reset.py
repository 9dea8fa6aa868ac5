"""The reset ladder on the real kernel (tests/lab/guest/reset_scenarios.py): rung 1 on a function with FLR, rung 2
on a function behind a root port (and on the FLR function with its function resets forbidden), rung 3 for a
function without a reset method, a bus reset refused because it would reach a busy function of the group, and one
refused because it would reach functions of *another* group. One lab boot with more functions behind more root
ports.

The other-group topology: an edu on a switch's internal bus (below the upstream port) beside a downstream port with
an edu below it. The kernel gives the edu a group of its own (its path up has ACS: QEMU's root port; a
single-function upstream port counts as isolating), while the downstream port (QEMU 7.2's has no ACS) shares a group
with the edu below it; the edu, enumerated first, is offered `bus`. (An edu *beside* the upstream port, as a second
function, shares the port's group: that was tried first and gives no such case.)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.lab.harness import BootResult, LabImage, boot

pytestmark = pytest.mark.vm

RESET_TOPOLOGY = (
    "-device", "pcie-root-port,id=rp3,chassis=3,slot=3,addr=06.0",
    "-device", "virtio-rng-pci,id=rng0,bus=rp3",
    "-device", "pcie-root-port,id=rp4,chassis=4,slot=4,addr=07.0",
    "-device", "edu,id=pf0,bus=rp4,addr=00.0,multifunction=on",
    "-device", "edu,id=pf1,bus=rp4,addr=00.1",
    "-device", "pcie-root-port,id=rp5,chassis=5,slot=5,addr=08.0",
    "-device", "x3130-upstream,id=up5,bus=rp5",
    "-device", "edu,id=sw0,bus=up5,addr=00.0",
    "-device", "xio3130-downstream,id=dn5,bus=up5,addr=01.0,chassis=6,slot=6",
    "-device", "edu,id=below5,bus=dn5",
)  # fmt: skip
PLAN = ["ladder_flr", "ladder_bus", "ladder_no_reset", "ladder_refused_busy", "ladder_refused_other_group"]


@pytest.fixture(scope="module")
def lab(lab_image: LabImage, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BootResult]:
    yield boot(
        lab_image,
        tmp_path_factory.mktemp("lab-reset"),
        PLAN,
        modules="scenarios,reset_scenarios",
        extra_args=RESET_TOPOLOGY,
    )


def _rungs(r: dict[str, Any]) -> list[tuple[str, bool | str | None]]:
    return [(a["rung"], a.get("ok", a.get("code"))) for a in r["attempts"]]


def test_rung_1_is_the_functions_flr_and_rung_2_narrows_reset_method_to_bus(lab: BootResult) -> None:
    r = lab.scenario("ladder_flr")
    fn = r["function"]
    print(f"reset ladder lab: {lab.total_s:.1f} s; " + ", ".join(f"{k} {v['ms']} ms" for k, v in r.items()))
    assert "flr" in fn["reset_method"] and "bus" in fn["reset_method"], fn
    assert _rungs(fn) == [("function", True)] and fn["attempts"][0]["methods"][0] == "flr"
    assert fn["problems"] == [] and fn["identity_same"] and fn["validate_after"] == []
    # rung 2 narrowed to `bus` on the same function: written and put back, but this kernel refuses a bus reset of
    # the virtio function (ENOTTY, measured), so the ladder ends in quarantine with the kernel's answer
    bus = r["bus"]
    assert _rungs(bus) == [("bus", False), ("quarantine", "backend.reset_failed")], bus["attempts"]
    assert bus["attempts"][0]["methods"] == ["bus"] and bus["reach"] == [bus["address"]]
    (p,) = bus["problems"]
    assert p["code"] == "backend.reset_failed" and "Inappropriate ioctl" in p["message"] and not p["hard"]
    assert bus["reset_method_after"].split() == bus["reset_method"]  # the function's own list is back


def test_rung_2_bus_reset_behind_a_root_port(lab: BootResult) -> None:
    r = lab.scenario("ladder_bus")
    assert r["reset_method"] == ["bus"] and r["reach"] == [r["address"]]
    assert _rungs(r) == [("bus", True)] and r["problems"] == []
    assert r["identity_same"] and r["validate_after"] == []


def test_rung_3_a_function_without_a_reset_method_is_quarantined(lab: BootResult) -> None:
    r = lab.scenario("ladder_no_reset")
    assert r["reset_method"] == [] and r["reach"] is None  # on the root complex: no bridge above
    assert [(p["code"], p["hard"]) for p in r["problems"]] == [("backend.no_reset_method", False)]


def test_a_bus_reset_reaching_a_busy_function_of_the_group_is_refused_naming_it(lab: BootResult) -> None:
    r = lab.scenario("ladder_refused_busy")
    pf1 = r["pf1"]
    for case in ("held", "claimed"):
        c = r[case]
        assert c["reach"] == [c["address"], pf1]
        (p,) = c["problems"]
        assert p["code"] == "backend.bus_reset_refused" and pf1 in p["message"], (case, p)
        assert not any(a.get("ok") for a in c["attempts"])  # nothing was reset
    assert "held by" in r["held"]["problems"][0]["message"]
    assert "reserved (sandbox sb-lab)" in r["claimed"]["problems"][0]["message"]
    # idle: the rule allows it, and the kernel, which listed `bus` for function 0 when it was alone on its bus at
    # enumeration, refuses the reset now that function 1 shares the bus (ENOTTY, measured) → quarantine
    idle = r["idle"]
    assert idle["reset_method"] == ["bus"] and idle["reach"] == [idle["address"], pf1]
    assert _rungs(idle) == [("bus", False), ("quarantine", "backend.reset_failed")], idle["attempts"]
    assert "Inappropriate ioctl" in idle["problems"][0]["message"]


def test_a_bus_reset_reaching_a_function_of_another_group_is_refused_naming_it(lab: BootResult) -> None:
    r = lab.scenario("ladder_refused_other_group")
    print("other-group topology:", r["groups"], r["reset_method"], r["attempts"])
    mine = r["group"]
    others = sorted(a for a, g in r["groups"].items() if g != mine)
    assert len(others) == 2, r["groups"]  # the downstream port and the edu below it
    assert r["reach"][0] == r["address"] and set(others) <= set(r["reach"])
    (p,) = r["problems"]
    assert p["code"] == "backend.bus_reset_refused" and all(a in p["message"] for a in others), p
    assert not any(a.get("ok") for a in r["attempts"])  # nothing was reset
