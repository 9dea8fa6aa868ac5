"""What a sandbox or scrub VM leaves under `STATE_DIR/shims/`, and how long it is kept (issue 30 #4).

Each run has up to three entries: its run directory `ID/` (console log and its `.1`, the VMM's log, pid files,
reports, sockets), its spec `ID.json` and its shim's log `ID.log`. While the run is live they stay where the
shim and the release rules look for them. Once it is over — a sandbox's reservation closed, a scrub VM ended —
they are moved together into `shims/finished/<ns-time>-ID/` (sockets dropped), and of the finished runs only the
newest `keep` (default 32, `CUBEACCEL_KEEP_FINISHED_RUNS`) are kept for post-mortems; older ones are deleted.
A run left by a crash (files, no reservation, no process) is retired at the Cubelet's next reconcile.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import time
from collections.abc import Callable
from pathlib import Path

from cubeaccel.host.vmm.vmmproc import find_shim, find_vmm
from cubeaccel.model.ids import SANDBOX_ID_RE

FINISHED = "finished"
KEEP_ENV = "CUBEACCEL_KEEP_FINISHED_RUNS"
DEFAULT_KEEP = 32
NOT_RUNS = frozenset({FINISHED, "forkserver", "template-prepare"})


def keep_finished() -> int:
    raw = os.environ.get(KEEP_ENV, "").strip()
    try:
        return max(0, int(raw)) if raw else DEFAULT_KEEP
    except ValueError:
        return DEFAULT_KEEP


def _sid(entry: Path) -> str | None:
    """A run is named by its directory or its spec (written before its shim starts); a log alone is not a run
    (the fork server's and template preparation's logs live beside the runs)."""
    name = entry.name
    if entry.is_dir() and not entry.is_symlink():
        sid = name
    elif name.endswith(".json") and entry.is_file():
        sid = name.removesuffix(".json")
    else:
        return None
    return sid if sid not in NOT_RUNS and SANDBOX_ID_RE.fullmatch(sid) else None


def runs(root: Path) -> set[str]:
    """The ids that have files under `root` (not yet retired)."""
    try:
        entries = list(root.iterdir())
    except OSError:
        return set()
    return {sid for e in entries if (sid := _sid(e)) is not None}


def retire(root: Path, sid: str, keep: int | None = None) -> Path | None:
    """Move run `sid`'s files into `root/finished/`, then prune the finished runs to the newest `keep`. The
    caller knows the run is over (no process of it runs, nothing will read its live files again)."""
    entries = [p for p in (root / sid, root / f"{sid}.json", root / f"{sid}.log") if p.exists()]
    if not entries:
        return None
    finished = root / FINISHED
    finished.mkdir(mode=0o700, exist_ok=True)
    dest = finished / f"{time.time_ns():020d}-{sid}"
    if (root / sid).is_dir():
        os.replace(root / sid, dest)
        for p in dest.iterdir():  # sockets are of no use to a post-mortem
            with contextlib.suppress(OSError):
                if stat.S_ISSOCK(p.lstat().st_mode):
                    p.unlink()
    else:
        dest.mkdir(mode=0o700)
    for src, name in ((root / f"{sid}.json", "spec.json"), (root / f"{sid}.log", "shim.log")):
        with contextlib.suppress(FileNotFoundError):
            os.replace(src, dest / name)
    prune(root, keep_finished() if keep is None else keep)
    return dest


def prune(root: Path, keep: int) -> list[str]:
    """Delete all but the newest `keep` finished runs (their names start with the retire time)."""
    try:
        done = sorted(p.name for p in (root / FINISHED).iterdir())
    except OSError:
        return []
    old = done[: max(0, len(done) - keep)]
    for name in old:
        shutil.rmtree(root / FINISHED / name, ignore_errors=True)
    return old


def retire_over(root: Path, open_ids: Callable[[], set[str]], proc: Path, skip_prefix: str = "scrub-") -> list[str]:
    """Retire every sandbox run under `root` that is over: no open reservation and no shim or VMM of it in
    /proc. The reservations are read after the listing (a run's reservation exists before its spec is
    written), so a sandbox starting meanwhile is never taken for one that is over. Scrub VMs (`skip_prefix`)
    are their runner's to retire."""
    listed = runs(root)
    out = []
    for sid in sorted(listed - open_ids()):
        if sid.startswith(skip_prefix):
            continue
        live = find_shim(sid, proc, under=root) is not None or find_vmm(sid, proc, under=root) is not None
        if not live and retire(root, sid) is not None:
            out.append(sid)
    return out
