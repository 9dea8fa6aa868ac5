"""The node's journal as the lifecycle uses it: one store, one lifecycle lock, the custody audit settled per change.

Built once by the composition root (`cubelet/runtime.py`) and handed to the Cubelet and to the release path, so
both make their decisions through the same lock and the same `change()`; neither owns the other's copy.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from cubeaccel.cubelet.device_audit import DeviceAudit
from cubeaccel.cubelet.store import Store, Tx


class Journal:
    """`store`: the SQLite journal. `device_audit`: the custody audit fed by the store's events (None: a node
    built without an audit log, as unit tests build it), settled at the end of every `change()`."""

    def __init__(self, store: Store, device_audit: DeviceAudit | None = None) -> None:
        self.store = store
        self.device_audit = device_audit
        self.lock = threading.RLock()  # lifecycle decisions: held only around short transactions, never host I/O

    @contextmanager
    def change(self) -> Iterator[Tx]:
        """One lifecycle decision: under the lifecycle lock, in one transaction, durable on return."""
        try:
            with self.lock, self.store.tx() as t:
                yield t
        finally:
            if self.device_audit is not None:
                self.device_audit.settle()  # the change's audit entries are on disk too before anything is replied
