"""Bounds more than one component enforces, in one place, so CubeMaster never admits what a Cubelet refuses.

CubeMaster used to accept 16 TiB of guest memory where Cubelet stopped at 4 TiB: a create could pass the
API and template registration and then be refused by every node.
"""

from __future__ import annotations

MIN_MEMORY_MIB = 64
MAX_MEMORY_MIB = 4 << 20  # 4 TiB: a request's, a template's and a reservation's guest memory
