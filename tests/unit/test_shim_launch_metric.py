"""`cubeaccel_shim_launches_total{how}`: the shim driver's own count of forked and spawned starts, served as
the driver counts it, and absent for a driver that counts nothing (the simulated one)."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from cubeaccel.cubelet.metrics import CubeletMetrics
from tests.support.cubelet_harness import Node


def _launches(node: Node) -> dict[str, float] | None:
    text = generate_latest(CubeletMetrics(node.cubelet).registry).decode()
    for family in text_string_to_metric_families(text):
        if family.name == "cubeaccel_shim_launches":
            return {s.labels["how"]: s.value for s in family.samples if s.name.endswith("_total")}
    return None


def test_a_counting_driver_has_its_forks_and_spawns_served(node: Node) -> None:
    launches = node.shim.launches = {"fork": 3, "spawn": 1}
    assert _launches(node) == {"fork": 3.0, "spawn": 1.0}
    launches["fork"] += 1
    assert _launches(node) == {"fork": 4.0, "spawn": 1.0}  # read at each scrape


def test_a_driver_that_does_not_count_serves_no_launch_series(node: Node) -> None:
    assert node.cubelet.shim.launches is None
    assert _launches(node) is None
