"""State that is nobody else's business: created owner-only, whatever the parent directory allows.

`master.db` holds every tenant's records and idempotency keys, a template snapshot is guest memory, and the
Cubelet's unix socket accepts shim reports (VM evidence) and operator verbs. Every daemon (`cubelet serve`,
`master serve`, `shim run`, `up`) starts with umask 077, so what it and its children (QEMU: sockets, the
snapshot, logs) create is 0600/0700; files that may predate that are tightened where they are opened.
"""

from __future__ import annotations

import os
from pathlib import Path

PRIVATE_UMASK = 0o077


def private_umask() -> None:
    os.umask(PRIVATE_UMASK)


def private_file(path: Path) -> Path:
    """Create `path` empty if missing, owner-only (0600) either way; its parent is created 0700."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o600)
    try:
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)
    return path
