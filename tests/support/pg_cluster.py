"""A throwaway PostgreSQL cluster (the replica tests' session fixture and the benchmarks): initdb in a temp dir,
unix socket only, no TCP. As root the server runs as `postgres` (`runuser`: root cannot run initdb); fsync and
synchronous commit off (a throwaway cluster; benchmark numbers say so).
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
from pathlib import Path


def pg_binary(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return candidates[-1] if candidates else None


class PgCluster:
    def __init__(self, max_connections: int = 300) -> None:
        initdb, pg_ctl = pg_binary("initdb"), pg_binary("pg_ctl")
        if initdb is None or pg_ctl is None:
            raise RuntimeError("PostgreSQL server binaries (initdb, pg_ctl) are not installed")
        self.pg_ctl = pg_ctl
        self.as_pg: list[str] = []
        self.root = Path(tempfile.mkdtemp(prefix="cubeaccel-pg-"))
        if os.geteuid() == 0:
            self.as_pg = ["runuser", "-u", "postgres", "--"]
            shutil.chown(self.root, "postgres", "postgres")
        self.data = self.root / "data"
        subprocess.run(
            [*self.as_pg, initdb, "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8", "-N"],
            check=True,
            capture_output=True,
        )
        opts = (
            f"-c listen_addresses='' -k {self.root} -c fsync=off -c synchronous_commit=off"
            f" -c max_connections={max_connections}"
        )
        subprocess.run(
            [
                *self.as_pg,
                pg_ctl,
                "-D",
                str(self.data),
                "-o",
                opts,
                "-l",
                str(self.root / "pg.log"),
                "-w",
                "-t",
                "60",
                "start",
            ],
            check=True,
            capture_output=True,
        )
        self.url = f"postgresql://postgres@/postgres?host={self.root}"

    def pids(self) -> list[int]:
        """The server's processes (postmaster and backends): the postmaster's pid and its children."""
        head = (self.data / "postmaster.pid").read_text().split()[0]
        out = [int(head)]
        for p in Path("/proc").iterdir():
            if p.name.isdigit():
                try:
                    ppid = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                if ppid == int(head):
                    out.append(int(p.name))
        return out

    def stop(self) -> None:
        subprocess.run(
            [*self.as_pg, self.pg_ctl, "-D", str(self.data), "-m", "immediate", "-w", "stop"], capture_output=True
        )
        shutil.rmtree(self.root, ignore_errors=True)
