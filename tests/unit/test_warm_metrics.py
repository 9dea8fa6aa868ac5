"""The Cubelet's warm-pool metrics (docs/observability.md): size, warm and starting, claims, misses by reason,
failed warm starts, refill time and the drain, read from the pools and the journal at each scrape. A real
Cubelet and SQLite store on simulated devices; each refill pass is run by the test (its warm starts run on
their real threads)."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from cubeaccel.cubelet.lifecycle import ReservationRequest
from cubeaccel.cubelet.metrics import CubeletMetrics
from cubeaccel.protocol.errors import CubeError
from tests.support.cubelet_harness import Node
from tests.support.poll import poll

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _scrape(metrics: CubeletMetrics) -> Samples:
    text = generate_latest(metrics.registry).decode()
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        if family.name.startswith("cubeaccel_warm"):
            for s in family.samples:
                labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "pool"))
                out[(s.name, labels)] = s.value
    return out


def _miss(node: Node, sid: str, req: ReservationRequest) -> str:
    try:
        node.cubelet.warm.claim(sid, req)
    except CubeError as e:
        return str(e.details["reason"])
    raise AssertionError("claimed")


def test_pool_size_warm_claims_misses_failures_refill_time_and_drain_are_served(node: Node) -> None:
    warm = node.cubelet.warm
    metrics = CubeletMetrics(node.cubelet)  # as the composition root builds them, one per Cubelet
    shape = ReservationRequest(count=1, template="t-1")
    t = (("template", "t-1"),)
    warm.set_pool(shape, 1)
    assert _scrape(metrics)[("cubeaccel_warm_pool_size", t)] == 1
    assert _scrape(metrics)[("cubeaccel_warm_sandboxes", (("state", "warm"), *t))] == 0
    warm.refill_once()
    poll(lambda: _scrape(metrics)[("cubeaccel_warm_sandboxes", (("state", "warm"), *t))] == 1, 20)
    m = _scrape(metrics)
    assert m[("cubeaccel_warm_refill_seconds_count", t)] == 1 and m[("cubeaccel_warm_refill_seconds_sum", t)] > 0

    warm.claim("tenant-1", shape)
    assert _miss(node, "tenant-2", shape) == "warm.pool_empty"
    assert _miss(node, "tenant-3", ReservationRequest(count=1, vcpus=2)) == "warm.no_pool"
    m = _scrape(metrics)
    assert m[("cubeaccel_warm_claims_total", t)] == 1
    assert m[("cubeaccel_warm_misses_total", (("reason", "warm.pool_empty"),))] == 1
    assert m[("cubeaccel_warm_misses_total", (("reason", "warm.no_pool"),))] == 1

    # A pool this node cannot fill (more devices than it has): each warm start fails and is counted.
    big = ReservationRequest(count=64, template="t-big")
    warm.set_pool(big, 1)
    failures = ("cubeaccel_warm_start_failures_total", (("template", "t-big"),))
    poll(lambda: warm.refill_once() is not None and _scrape(metrics).get(failures) == 1, 20)  # once t-1's start is done
    assert _scrape(metrics)[("cubeaccel_warm_start_failures_total", t)] == 0

    assert _scrape(metrics)[("cubeaccel_warm_draining", ())] == 0
    warm.drain()
    assert _scrape(metrics)[("cubeaccel_warm_draining", ())] == 1
    assert _miss(node, "tenant-4", shape) == "warm.drained"
    assert _scrape(metrics)[("cubeaccel_warm_misses_total", (("reason", "warm.drained"),))] == 1
