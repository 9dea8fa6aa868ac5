"""Cubelet ↔ its shim fork server: one request per sandbox start, one reply.

The request carries what `Popen` would have given the shim — its environment and working directory as Cubelet
has them now, the workload token that otherwise goes on the shim's stdin — so a forked shim runs exactly as a
spawned one would. The log file comes beside the request as a descriptor (SCM_RIGHTS), never as a path the
fork server would open.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, SecretStr, StrictInt, StrictStr, field_validator

from cubeaccel.wire.base import Message

MAX_REQUEST_BYTES = 256 * 1024  # an environment of a few hundred variables fits many times over
MAX_ENV = 1024
SOCKET_NAME = "forkserver.sock"  # in the driver's shims/ directory, owner-only like the directory itself
SHIM_ARGV_PREFIX = ("-m", "cubeaccel.shim", "run")  # after the interpreter: the only command it forks


class ShimLaunchRequest(Message):
    # The spawned shim's argv, interpreter first: the forked one shows it in /proc/PID/cmdline (that is how
    # Cubelet finds a shim again, also after a restart) and runs its command line.
    argv: tuple[StrictStr, ...] = Field(max_length=64)
    env: dict[StrictStr, StrictStr] = Field(max_length=MAX_ENV)
    cwd: Annotated[StrictStr, Field(pattern=r"^/", max_length=4096)]
    workload_token: SecretStr | None = None

    @field_validator("argv")
    @classmethod
    def _no_nul(cls, argv: tuple[str, ...]) -> tuple[str, ...]:
        if any("\0" in a or not a for a in argv) or argv[1:4] != SHIM_ARGV_PREFIX:
            raise ValueError(f"argv: INTERPRETER {' '.join(SHIM_ARGV_PREFIX)} ..., non-empty strings without NUL")
        return argv


class ShimLaunchReply(Message):
    """`pid` once the forked shim shows its argv (findable in /proc), else `error` (Cubelet then spawns)."""

    pid: Annotated[StrictInt, Field(gt=1)] | None = None
    error: Annotated[StrictStr, Field(max_length=2000)] | None = None
