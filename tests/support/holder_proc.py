"""A real process that holds files open until told to exit (or forever), for holder tests."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

_SCRIPT = """
import sys
handles = [open(p, "rb") for p in sys.argv[1:]]
print("ready", flush=True)
sys.stdin.read()
"""


def unreadable_pids() -> frozenset[int]:
    """Processes of this host whose fds we cannot read (here: the sandbox runtime's PID 1). Tests that scan the
    real /proc exempt exactly these, as an operator would with `--holder-scan-exempt-pid`."""
    from cubeaccel.host.pci import procfs

    return frozenset(h.pid for h in procfs.find_holders(procfs.glob("/nonexistent/*")) if h.unknown and h.pid)


@contextmanager
def holding(*paths: Path) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _SCRIPT, *map(str, paths)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=10)
