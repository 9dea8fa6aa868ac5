"""The lifecycle lock: reentrant, exclusive, and handed to waiters in the order they arrived."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from cubeaccel.cubelet.locks import FairRLock
from tests.support.poll import poll


def test_waiters_get_the_lock_in_arrival_order() -> None:
    lock, order = FairRLock(), []
    lock.acquire()
    threads = []
    for i in range(8):

        def take(i: int = i) -> None:
            with lock:
                order.append(i)

        t = threading.Thread(target=take)
        t.start()
        threads.append(t)
        poll(lambda n=i + 1: len(lock._waiters) == n, 10, 0.002, what=f"waiter {i} queued")
    lock.release()
    for t in threads:
        t.join(10)
    assert order == list(range(8))


def test_reentrant_for_its_owner_and_exclusive_for_others() -> None:
    lock = FairRLock()
    got = threading.Event()
    with lock, lock:
        t = threading.Thread(target=lambda: (lock.acquire(), got.set(), lock.release()))
        t.start()
        poll(lambda: len(lock._waiters) == 1, 10, 0.002, what="the other thread queued")
        assert not got.is_set()
    t.join(10)
    assert got.is_set() and lock._owner is None


def test_only_the_owner_may_release() -> None:
    lock = FairRLock()
    with pytest.raises(RuntimeError):
        lock.release()
    lock.acquire()
    errors: list[BaseException] = []

    def foreign() -> None:
        try:
            lock.release()
        except RuntimeError as e:
            errors.append(e)

    t = threading.Thread(target=foreign)
    t.start()
    t.join(10)
    assert len(errors) == 1
    lock.release()


def test_many_threads_never_hold_it_at_once() -> None:
    lock, inside, worst = FairRLock(), [0], [0]

    def work() -> None:
        for _ in range(300):
            with lock:
                inside[0] += 1
                worst[0] = max(worst[0], inside[0])
                time.sleep(0)  # let the GIL go inside the section: without the lock, others get in here
                with lock:  # reentry inside the critical section
                    pass
                inside[0] -= 1

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert worst[0] == 1 and inside[0] == 0 and lock._owner is None


class _Interrupted(Exception):
    pass


def _interrupt(signum: int, frame: object) -> None:
    raise _Interrupted


def test_a_waiter_interrupted_by_a_signal_leaves_the_queue_and_the_lock_keeps_working() -> None:
    """Ctrl-C in a CLI that waits for the lock: the waiter goes, nothing is left queued or owned by it."""
    lock, release_holder, held = FairRLock(), threading.Event(), threading.Event()

    def holder() -> None:
        with lock:
            held.set()
            release_holder.wait(10)

    h = threading.Thread(target=holder)
    h.start()
    poll(held.is_set, 10, 0.002, what="the holder has the lock")
    main = threading.get_ident()
    killer = threading.Thread(
        target=lambda: (
            poll(lambda: len(lock._waiters) == 1, 10, 0.002, what="main queued"),
            signal.pthread_kill(main, signal.SIGUSR1),
        )
    )
    previous = signal.signal(signal.SIGUSR1, _interrupt)
    try:
        killer.start()
        with pytest.raises(_Interrupted):
            lock.acquire()
    finally:
        signal.signal(signal.SIGUSR1, previous)
        killer.join(10)
    assert len(lock._waiters) == 0 and lock._owner == h.ident
    release_holder.set()
    h.join(10)
    with lock:
        assert lock._owner == main
    assert lock._owner is None
