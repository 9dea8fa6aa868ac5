"""This host's load stretch for deadlines that wait on a guest: a TCG guest runs as fast as its host lets it."""

from __future__ import annotations

import os

from cubeaccel.protocol.agent_protocol import deadline_scale


def host_deadline_scale() -> float:
    """`deadline_scale` of this host's 1-minute load (1 where it cannot be read)."""
    try:
        load = os.getloadavg()[0]
    except OSError:
        return 1.0
    return deadline_scale(load, os.cpu_count() or 1)
