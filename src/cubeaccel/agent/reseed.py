"""Mixing the host's seed into the guest kernel's RNG at a warm sandbox's claim (docs/warm.md).

Warm guests restored from one template snapshot start with the same RNG state; a claim sends 32 bytes from the
host's CSPRNG so no two tenants' guests draw the same numbers. Written to the pool (anyone may: mixed, not
credited), then, as root, credited with RNDADDENTROPY and the kernel's CRNG reseeded at once with RNDRESEEDCRNG,
so the next read already depends on the seed rather than after the kernel's own reseed interval.
"""

from __future__ import annotations

import fcntl
import os
import stat
import struct
from dataclasses import replace
from pathlib import Path

from cubeaccel.protocol.agent_messages import ReseedResult

RNDADDENTROPY = 0x40085203  # _IOW('R', 0x03, int[2]): struct rand_pool_info {entropy_count, buf_size, buf[]}
RNDRESEEDCRNG = 0x5207  # _IO('R', 0x07)
SEED_BYTES = 32


def reseed(seed: bytes, device: Path = Path("/dev/urandom")) -> ReseedResult:
    """Mix `seed` in; credit it and reseed the CRNG where the kernel lets this process. Returns what was done:
    `mixed` (the write took), `credited_bits`, `crng_reseeded`, and `why_not` when a step was skipped."""
    fd = os.open(device, os.O_WRONLY)
    try:
        written = os.write(fd, seed)
        out = ReseedResult(mixed=written == len(seed), credited_bits=0, crng_reseeded=False)
        if not stat.S_ISCHR(os.fstat(fd).st_mode):
            return replace(out, why_not="not a character device")
        if os.geteuid() != 0:
            return replace(out, why_not="not root: mixed, not credited")
        bits = 8 * len(seed)
        try:
            fcntl.ioctl(fd, RNDADDENTROPY, struct.pack("ii", bits, len(seed)) + seed)
            out = replace(out, credited_bits=bits)
            fcntl.ioctl(fd, RNDRESEEDCRNG)
            return replace(out, crng_reseeded=True)
        except OSError as e:
            return replace(out, why_not=f"ioctl: {e.strerror or e}")
    finally:
        os.close(fd)
