"""CubeMaster's Prometheus metrics and its sandbox-transition log lines (docs/observability.md lists them).

Node and device gauges are computed at scrape time from the node cache (the Cubelets' summaries); counters
are fed where the thing happens: a scheduling decision (`CubeMaster.on_decision`), a create's outcome (the
route), a sandbox state change (`MasterStore.listeners`, after its transaction). Per-device states live on
the Cubelets (`cubeaccel_device_state` there); here are the cluster's summaries.
"""

from __future__ import annotations

import logging
import time
from collections import Counter as Tally
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from cubeaccel.master.records import SandboxChange
from cubeaccel.master.scheduler import Decision
from cubeaccel.master.service import CubeMaster
from cubeaccel.transport.telemetry import API_BUCKETS, ApiTelemetry

log = logging.getLogger("cubeaccel.master")


class _Nodes(Collector):
    def __init__(self, master: CubeMaster) -> None:
        self.master = master

    def collect(self) -> Iterator[Metric]:
        now, staleness = time.time(), self.master.config.staleness_s
        nodes = GaugeMetricFamily("cubeaccel_nodes", "Nodes by state (ready, draining, stale, …)", labels=["state"])
        devices = GaugeMetricFamily(
            "cubeaccel_node_devices",
            "Devices per node, class and model from the node's last summary: total and allocatable",
            labels=["Hostname", "class", "modelName", "kind"],
        )
        states: Tally[str] = Tally()
        for v in self.master.cache.views():
            states["stale" if v.stale(now, staleness) else v.state] += 1
            per: dict[tuple[str, str], list[int]] = {}
            for g in v.groups:
                key = (g.accel_class, str(g.labels.get("model", "")))
                acc = per.setdefault(key, [0, 0])
                acc[0] += g.total
                acc[1] += max(0, v.free(g))
            for (cls, model), (total, free) in sorted(per.items()):
                devices.add_metric([v.name, cls, model, "total"], total)
                devices.add_metric([v.name, cls, model, "allocatable"], free)
        for state, n in sorted(states.items()):
            nodes.add_metric([state], n)
        yield nodes
        yield devices
        yield self._warm_pools(now, staleness)

    def _warm_pools(self, now: float, staleness: float) -> Metric:
        pools = GaugeMetricFamily(
            "cubeaccel_warm_pool_sandboxes",
            "Warm sandboxes per node and pool from the node's last heartbeat: size (wanted), warm, starting, "
            "claimable (warm and held by no create's claim)",
            labels=["Hostname", "pool", "template", "kind"],
        )
        for v in self.master.cache.views():
            if v.stale(now, staleness):
                continue
            for p in v.warm_pools:
                counts = {"size": p.size, "warm": p.warm, "starting": p.starting, "claimable": len(v.warm_free(p))}
                for kind, n in counts.items():
                    pools.add_metric([v.name, p.key, p.template or "", kind], n)
        return pools

    def describe(self) -> Iterator[Metric]:
        return iter(())


class MasterMetrics:
    def __init__(self, master: CubeMaster) -> None:
        r = self.registry = CollectorRegistry()
        self.api = ApiTelemetry(r, "cubemaster")
        r.register(_Nodes(master))
        self.decisions = Counter(
            "cubeaccel_scheduler_decisions",
            "Scheduling decisions by outcome: placed, unschedulable",
            ["outcome"],
            registry=r,
        )
        self.rejections = Counter(
            "cubeaccel_scheduler_rejections",
            "Nodes ruled out in decisions that placed nothing, by reason (node_stale, insufficient_devices, …)",
            ["reason"],
            registry=r,
        )
        self.decision_seconds = Histogram(
            "cubeaccel_scheduler_decision_seconds", "Time to decide a placement", registry=r, buckets=API_BUCKETS
        )
        self.creates = Counter(
            "cubeaccel_sandbox_creates",
            "Sandbox creates by outcome (created, replayed, refused) and error code",
            ["outcome", "reason"],
            registry=r,
        )
        self.create_seconds = Histogram(
            "cubeaccel_sandbox_create_seconds",
            "Create requests by outcome",
            ["outcome"],
            registry=r,
            buckets=API_BUCKETS,
        )
        self.transitions = Counter(
            "cubeaccel_sandbox_transitions",
            "Sandbox state changes by event, actor and target state",
            ["event", "actor", "to_state"],
            registry=r,
        )
        self.create_paths = Counter(
            "cubeaccel_sandbox_create_paths",
            "Creates by path: warm (a warm sandbox was claimed) or cold, with the miss reason (warm.no_pool, …)",
            ["path", "reason"],
            registry=r,
        )
        master.on_decision = self.decision
        master.on_path = self.path
        master.store.listeners.append(self.sandbox_changed)

    def decision(self, decision: Decision, seconds: float) -> None:
        self.decision_seconds.observe(seconds)
        if decision.candidates:
            self.decisions.labels("placed").inc()
            return
        self.decisions.labels("unschedulable").inc()
        for out in decision.outcomes:
            for reason in out.reasons.values():
                self.rejections.labels(reason.code).inc()

    def path(self, path: str, reason: str) -> None:
        self.create_paths.labels(path, reason).inc()

    def created(self, outcome: str, seconds: float, reason: str = "") -> None:
        self.creates.labels(outcome, reason).inc()
        self.create_seconds.labels(outcome).observe(seconds)

    def sandbox_changed(self, change: SandboxChange) -> None:
        self.transitions.labels(change.event, change.actor, change.to_state).inc()
        if log.isEnabledFor(logging.INFO):
            log.info("sandbox_transition", extra={"fields": change.to_json()})


def metrics_of(master: CubeMaster) -> MasterMetrics:
    existing: Any = getattr(master, "metrics", None)
    if isinstance(existing, MasterMetrics):
        return existing
    m = MasterMetrics(master)
    master.metrics = m  # type: ignore[attr-defined]
    return m
