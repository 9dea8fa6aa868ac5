"""The environment of every process a component starts (issue 30 #6): built here, from an allowlist, never
inherited. Whatever the operator's shell exported (an admin key, a cloud token) stays in the parent.

- `component_env()`: our own processes (a shim, the shim fork server, a scrub VM's shim, a service `up`
  starts, a host tool such as `nft` or `mkfs`): the locale and search path, plus the `CUBEACCEL_*` settings
  that configure a child (`COMPONENT_VARS`); never a credential (`CUBEACCEL_API_KEY`, `…_FILE`,
  `CUBEACCEL_SANDBOX_TOKEN` are not on the list, nor is anything else). They run the code their parent runs:
  `PYTHONPATH` is the directory this `cubeaccel` was imported from, whatever the operator exported, so a
  stack started from a checkout or a worktree does not run an editable install's other tree in its children.
- `tool_env()`: a host tool (`nft`, `mkfs`): the locale and search path only.
- `vmm_env(tags)`: a VMM: a fixed `PATH` and the tags Cubelet's release rules read back from
  `/proc/PID/environ` — nothing of the parent at all.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

import cubeaccel

CODE_ROOT = str(Path(cubeaccel.__file__).resolve().parent.parent)  # what holds the package this process runs
SAFE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
BASE_VARS = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR", "HOME")
# Settings a child of ours reads (each one's reader: host/vmm/hypervisor.py, host/vmm/confine.py,
# transport/telemetry.py, transport/http_server.py, images/builder.py, cli/config, shim/console.py). A new setting a
# child needs is added here, by name.
COMPONENT_VARS = (
    "CUBEACCEL_QEMU",
    "CUBEACCEL_ACCEL",
    "CUBEACCEL_VMM_UIDS",
    "CUBEACCEL_VMM_UID_LOCKS",
    "CUBEACCEL_VMM_MEMLOCK",
    "CUBEACCEL_VMM_CONFINE_FAULT",
    "CUBEACCEL_LOG_LEVEL",
    "CUBEACCEL_CACHE_DIR",
    "XDG_CACHE_HOME",
    "CUBEACCEL_HTTP_HEADER_TIMEOUT_S",
    "CUBEACCEL_HTTP_BODY_TIMEOUT_S",
    "CUBEACCEL_HTTP_IDLE_TIMEOUT_S",
    "CUBEACCEL_CONFIG",
    "CUBEACCEL_CONSOLE_LOG_MAX_BYTES",
)


def component_env(
    extra: Mapping[str, str] | None = None,
    passed: Iterable[str] = COMPONENT_VARS,
    parent: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The allowlisted variables of `parent` (default: this process's environment), this code's root as the
    search path for Python, then `extra`."""
    env = tool_env(passed, parent)
    env["PYTHONPATH"] = CODE_ROOT
    env.update(extra or {})
    return env


def tool_env(passed: Iterable[str] = (), parent: Mapping[str, str] | None = None) -> dict[str, str]:
    src = os.environ if parent is None else parent
    env = {k: src[k] for k in (*BASE_VARS, *passed) if k in src}
    env.setdefault("PATH", SAFE_PATH)
    return env


def vmm_env(tags: Mapping[str, str]) -> dict[str, str]:
    """A VMM's whole environment: nothing of its parent's."""
    return {"PATH": SAFE_PATH, **tags}
