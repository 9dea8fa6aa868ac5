"""Older e2b SDK lines, each in its own directory (`pip install --target`, cached per machine): not importable
beside the pinned dev dependency, so they run in a subprocess with that directory first on its path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any


def sdk_path(version: str) -> Path:
    where = Path.home() / ".cache" / "cubeaccel" / f"e2b-sdk-{version}"
    if not (where / "e2b").is_dir():
        tmp = where.with_name(where.name + f".tmp{os.getpid()}")
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--target", str(tmp), f"e2b=={version}"],
            check=True,
            timeout=600,
        )
        tmp.rename(where)
    return where


def run_check(version: str, script: Path, args: list[str], key: str, url: str) -> dict[str, Any]:
    """Run `script` under SDK `version` against the front door at `url`; its last stdout line, parsed."""
    env = {
        "PATH": os.environ["PATH"],
        "HOME": os.environ.get("HOME", "/root"),
        "PYTHONPATH": str(sdk_path(version)),
        "E2B_API_KEY": key,
        "E2B_API_URL": url,
        "E2B_SANDBOX_URL": url,
    }
    r = subprocess.run([sys.executable, "-s", str(script), *args], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    seen: dict[str, Any] = json.loads(r.stdout.strip().splitlines()[-1])
    assert seen["version"] == version
    return seen
