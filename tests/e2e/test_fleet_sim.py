"""CubeMaster against the fleet simulator: 100 simulated nodes x 8 GPUs, creates racing random node deaths.

The fleet's own ledger (who each node handed each device to) is the judge, never CubeMaster's rows: a device
handed to two sandboxes, or a sandbox held on two nodes, is a double placement. Every create carries an
Idempotency-Key; whatever its first answer was (a sandbox, a refusal, a dropped connection), asking again with
the same key gives the same outcome, so no create is lost.
"""

from __future__ import annotations

import threading
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cubeaccel.fleet.api import Faults
from cubeaccel.fleet.sim import Fleet
from tests.support.master_harness import MasterProcess, example, wait_nodes_ready
from tests.support.poll import poll

NODES = 100
PERIOD_S = 0.5  # heartbeats; CubeMaster calls a node stale after 2 s without one


@dataclass
class Setup:
    master: MasterProcess
    fleet: Fleet


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    root = Path(tmp_path_factory.mktemp("fleet"))
    master = MasterProcess(root / "m", None, 2.0).start()
    faults = Faults(latency_s=0.001, jitter_s=0.004, error_rate=0.05)  # 5 % of reservations refused (host checks)
    fleet = Fleet([master.url], master.admin_key, NODES, faults=faults, period_s=PERIOD_S)
    try:
        fleet.start()
        wait_nodes_ready(master.client, set(fleet.names), 60)
        master.client.register_template(example("cuda12-h100", spec__memory__size_mib=1024), default=True)
        yield Setup(master, fleet)
    finally:
        fleet.stop()
        master.stop()


@dataclass(frozen=True)
class Answer:
    status: int  # 0: no HTTP answer (the connection failed)
    sandbox: str | None
    code: str | None


def create(master: MasterProcess, key: str, gpus: int) -> Answer:
    try:
        r = httpx.post(
            f"{master.url}/v1/sandboxes",
            json={"gpu": f"H100:{gpus}"},
            headers={**master.headers(), "Idempotency-Key": key},
            timeout=60,
        )
    except httpx.HTTPError:
        return Answer(0, None, None)
    body = r.json()
    if r.status_code in (200, 201):
        return Answer(r.status_code, body["id"], None)
    return Answer(r.status_code, None, body["error"]["code"])


steps = st.lists(
    st.tuples(
        # the nodes that die during the batch, as ranks in placement's likely order (most_likely_next)
        st.lists(st.integers(0, NODES - 1), max_size=12, unique=True),
        st.integers(0, 30),  # after this many creates were sent
        st.lists(st.sampled_from([1, 1, 1, 2, 4, 8]), min_size=1, max_size=40),  # the batch's creates (GPUs each)
    ),
    min_size=1,
    max_size=3,
)


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=steps)
def test_creates_against_100_simulated_nodes_with_random_deaths_never_double_place_or_lose_a_create(
    setup: Setup, steps: list[tuple[list[int], int, list[int]]]
) -> None:
    master, fleet = setup.master, setup.fleet
    run = uuid.uuid4().hex[:8]
    answers: dict[str, Answer] = {}
    lock = threading.Lock()
    try:
        for b, (deaths, after, gpus) in enumerate(steps):
            sent = threading.Semaphore(0)

            def one(k: int, n: int, b: int = b, sent: threading.Semaphore = sent) -> None:
                sent.release()
                key = f"{run}-{b}-{k}"
                a = create(master, key, n)
                with lock:
                    answers[key] = a

            with ThreadPoolExecutor(max_workers=16) as pool:
                futures = [pool.submit(one, k, n) for k, n in enumerate(gpus)]
                for _ in range(min(after, len(gpus))):
                    sent.acquire()
                order = most_likely_next(fleet)
                deaths = [order[r] for r in deaths]
                for i in deaths:
                    fleet.kill(i)
                for f in futures:
                    f.result()

            # The fleet's record: no device given twice, no sandbox on two nodes.
            assert fleet.ledger.double_placements == 0
            # Every create is answered or found again by its key: the same sandbox, or the same refusal.
            for key, first in answers.items():
                again = create(master, key, gpus_of(key, steps))
                if first.sandbox is not None:
                    assert again.sandbox == first.sandbox, (key, first, again)
                elif first.status == 0 or first.status >= 500:  # unanswered: its outcome is there now
                    assert again.status in (200, 201, 409), (key, first, again)
                else:
                    assert (again.sandbox, again.code) == (None, first.code), (key, first, again)
            # CubeMaster's running records agree with the fleet's: each device held by the sandbox it names.
            rows = [r for r in master.client.sandboxes("running") if r.id in placed(answers)]
            devices = Counter((str(r.node), d) for r in rows for d in r.device_ids)
            assert all(c == 1 for c in devices.values()), devices.most_common(3)
            ids: set[str | None] = {r.id for r in rows}
            for device in devices:
                assert fleet.ledger.holders.get(device) in ids
            for i in deaths:
                fleet.revive(i)
    finally:
        for i in list(fleet.faults.dead):
            fleet.revive(i)
        wait_nodes_ready(master.client, set(fleet.names), 30)
        mine = placed(answers)
        for r in master.client.sandboxes("running"):
            if r.id in mine:
                master.client.delete(r.id)
        poll(lambda: not set(fleet.ledger.placed) & mine, 30, what="this run's sandboxes released on the fleet")
    assert fleet.ledger.double_placements == 0


def most_likely_next(fleet: Fleet) -> list[int]:
    """Node indices, those CubeMaster is likeliest to place on next first (it packs: partly used nodes, fullest
    first; then idle ones; full ones last), so a random death hits placements in flight."""
    js = fleet.journals
    return sorted(range(len(js)), key=lambda i: (js[i].free == 0, js[i].free == len(js[i].device_ids), js[i].free, i))


def placed(answers: dict[str, Answer]) -> set[str]:
    return {a.sandbox for a in answers.values() if a.sandbox is not None}


def gpus_of(key: str, steps: list[tuple[list[int], int, list[int]]]) -> int:
    _, b, k = key.split("-")
    return steps[int(b)][2][int(k)]
