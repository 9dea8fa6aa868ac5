"""Guest limits for workload commands: a fork bomb or a memory hog stays inside its own cgroup.

Every command joins one cgroup v2 group, `/sys/fs/cgroup/cube-workload` (created at service start when we are
root), with `pids.max` (tasks, threads included), `memory.max` (what the guest has available when we start, less
a reserve for the services: the root filesystem is in RAM and cannot be reclaimed, so MemTotal would promise too
much) and a low `cpu.weight`. The services stay in the root group with `oom_score_adj` -1000 (the guest init
starts them so: the OOM killer never picks one), commands raise theirs (envd's 100), cgroup or not: a command at
its limits cannot stop us from accepting a call, starting a thread or killing it, and an OOM picks a command.
Commands of a non-root user also get RLIMIT_NPROC (per uid; the kernel exempts root, hence the cgroup).

How a command gets there before any of its code runs: it starts as
`/bin/sh -c 'kill -STOP $$; exec -a "$0" "$@"' CMD /abs/path/of/CMD ARGS…` (busybox, as the target user, plain
`fork`+`exec`: no Python runs in the child). We wait until it has stopped itself, move it into the group, set
its RLIMIT_NPROC (`prlimit`) and oom_score_adj from outside, and send
SIGCONT; it then `exec`s the command, already confined. Not `preexec_fn`: Python code in a child forked from our
threaded process copies much of our heap (64 concurrent starts ran a 256 MiB guest out of memory), and after
setuid the child could no longer write the root-owned `cgroup.procs`; joining from the parent without stopping
the child first would let a fast fork bomb's first children escape.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
GROUP_NAME = "cube-workload"
DEFAULT_MAX_TASKS = 512
MEMORY_RESERVE_MIB = 64  # of MemAvailable at start, kept for cube-agent and us (threads, buffers)
MEMORY_FLOOR_MIB = 32
SERVICE_OOM_SCORE_ADJ = -1000  # never chosen: the guest init starts every service with it (images/rootfs.py)
COMMAND_OOM_SCORE_ADJ = 100
COMMAND_CPU_WEIGHT = 20  # of the default 100: the services win the CPU from a busy command


# sh -c GATE ARGV0 PATH ARGS…: stops itself until confined, then becomes PATH with argv[0] kept. PATH is absolute:
# the guest's busybox ash runs its own applet for a bare name (`exec ls` would be busybox's ls, not coreutils').
GATE = 'kill -STOP $$; exec -a "$0" "$@"'


@dataclass
class CommandLimits:
    """What each command gets; `procs` is the group's `cgroup.procs` (None: no cgroup v2 here)."""

    max_tasks: int = DEFAULT_MAX_TASKS
    procs: str | None = None
    memory_max: int | None = None
    shell: str = "/bin/sh"

    def gated(self, argv0: str, path: str, args: list[str]) -> list[str]:
        return [self.shell, "-c", GATE, argv0, path, *args]

    def confine(self, pid: int, uid: int) -> int | None:
        """From the parent: wait for the gate to stop, confine, continue it. Returns the child's exit code if it
        ended instead of stopping (then the caller must not wait for it again)."""
        _, status = os.waitpid(pid, os.WUNTRACED)
        if not os.WIFSTOPPED(status):
            return os.waitstatus_to_exitcode(status)
        with contextlib.suppress(OSError):  # with or without a cgroup: never the services' -1000, inherited
            _write(f"/proc/{pid}/oom_score_adj", str(COMMAND_OOM_SCORE_ADJ).encode())
        if self.procs is not None:
            with contextlib.suppress(OSError):
                _write(self.procs, str(pid).encode())
        if uid:
            with contextlib.suppress(OSError, ValueError):
                resource.prlimit(pid, resource.RLIMIT_NPROC, (self.max_tasks, self.max_tasks))
        os.kill(pid, signal.SIGCONT)
        return None


def _write(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def setup(max_tasks: int = DEFAULT_MAX_TASKS, root: Path = CGROUP_ROOT) -> CommandLimits:
    """The commands' cgroup, created if we can (root, cgroup v2 mountable); else limits without one."""
    limits = CommandLimits(max_tasks=max_tasks)
    if os.geteuid() != 0:
        return limits
    try:
        if not (root / "cgroup.controllers").exists():
            root.mkdir(parents=True, exist_ok=True)
            rc = os.system(f"mount -t cgroup2 cgroup2 {root} 2>/dev/null")  # busybox mount; stdlib has none
            if rc != 0 or not (root / "cgroup.controllers").exists():
                return limits
        available = set((root / "cgroup.controllers").read_text().split())
        wanted = [c for c in ("pids", "memory", "cpu") if c in available]
        with contextlib.suppress(OSError):
            (root / "cgroup.subtree_control").write_text(" ".join("+" + c for c in wanted))
        group = root / GROUP_NAME
        group.mkdir(exist_ok=True)
        if (group / "pids.max").exists():
            (group / "pids.max").write_text(str(max_tasks))
        if (group / "memory.max").exists():
            limits.memory_max = _memory_budget()
            if limits.memory_max is not None:
                (group / "memory.max").write_text(str(limits.memory_max))
                with contextlib.suppress(OSError):
                    (group / "memory.swap.max").write_text("0")
        if (group / "cpu.weight").exists():
            (group / "cpu.weight").write_text(str(COMMAND_CPU_WEIGHT))
        limits.procs = str(group / "cgroup.procs")
        with contextlib.suppress(OSError):
            Path("/proc/self/oom_score_adj").write_text(str(SERVICE_OOM_SCORE_ADJ))
    except OSError:
        return limits
    return limits


def _memory_budget() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
                return max(available - MEMORY_RESERVE_MIB * 1024 * 1024, MEMORY_FLOOR_MIB * 1024 * 1024)
    except (OSError, ValueError, IndexError):
        return None
    return None
