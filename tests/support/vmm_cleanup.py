"""Stopping the VMMs a test started — and only those — on a host other test runs share.

Every VMM our code starts writes `vmm.pid` into its own state directory, and its QMP/API sockets live there. A
test cleans up by the directories it owns: each `vmm.pid` under them names a candidate, which is killed only
when /proc shows it is still a tagged VMM whose sockets are under that same directory (a reused pid, or another
run's VMM with the same sandbox id, is never touched). No scan of the host by tag pattern.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

from cubeaccel.host.vmm.vmmproc import inspect
from tests.support.poll import poll


def started_vmms(root: Path) -> list[int]:
    """Pids of live VMMs started under `root` (by pid file, verified in /proc)."""
    pids = []
    for pid_file in sorted(root.rglob("vmm.pid")) if root.is_dir() else []:
        with contextlib.suppress(OSError, ValueError):
            pid = int(pid_file.read_text().strip())
            p = inspect(pid)
            if p is not None and p.under(pid_file.parent):
                pids.append(pid)
    return pids


def kill_started_vmms(root: Path, timeout_s: float = 10.0) -> list[int]:
    """SIGKILL every live VMM started under `root` and wait until /proc no longer shows it; returns the pids."""
    pids = started_vmms(root)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    # Not our child (its own session): init reaps it.
    poll(lambda: all(inspect(pid) is None for pid in pids), timeout_s, 0.02, what=f"VMMs {pids} gone")
    return pids
