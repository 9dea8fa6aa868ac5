"""Where the CLI finds the servers: an explicit flag, then the environment, then the stack `cubeaccel up` started.

`sandbox …` always found `up`'s CubeMaster through `up.json`; the node verbs (`devices`, `device`, `events`,
`reservation`) now find `up`'s Cubelet the same way, through its unix socket (no credential needed there).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

UP_STATE = Path(os.environ.get("CUBEACCEL_UP_STATE_DIR", Path.home() / ".local/state/cubeaccel/up"))
CUBELET_STATE = Path(os.environ.get("CUBEACCEL_STATE_DIR", Path.home() / ".local/state/cubeaccel/cubelet"))


def up_info(up_state: Path | None = None) -> dict[str, object] | None:
    path = (up_state or UP_STATE) / "up.json"
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def cubelet_socket(state_dir: Path | None) -> Path:
    """`--state-dir`'s socket; without one the default Cubelet's, else the `up` stack's, else the default's
    (so the error names the place a Cubelet would be)."""
    if state_dir is not None:
        return state_dir / "cubelet.sock"
    default = CUBELET_STATE / "cubelet.sock"
    if default.exists():
        return default
    up = up_info()
    if up is not None:
        sock = Path(str(up.get("state_dir", UP_STATE))) / "cubelet" / "cubelet.sock"
        if sock.exists():
            return sock
    return default
