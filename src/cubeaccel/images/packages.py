"""Debian packages as build inputs: resolve exact versions, `apt-get download` into the cache, extract.

Only apt's configured repositories are used (no other network). Exact versions are part of the image's cache key,
so a point release of the kernel or python produces a new image and a new digest.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from cubeaccel.model.errors import CubeError

KERNEL_META = "linux-image-amd64"
_KERNEL_PKG = re.compile(r"linux-image-(\d+\.\d+\.\d+-\d+-amd64)")


def image_error(code: str, message: str, layer: str = "guest_kernel", **details: object) -> CubeError:
    """Image build failures name the contract layer whose artifact could not be produced."""
    return CubeError(code=code, message=message, layer=layer, details=dict(details), status=500)


@dataclass(frozen=True)
class Package:
    name: str
    version: str

    def to_json(self) -> dict[str, str]:
        return {"name": self.name, "version": self.version}


def _run(args: list[str], cwd: Path | None = None) -> str:
    if shutil.which(args[0]) is None:
        raise image_error("image.tool_missing", f"{args[0]} not found; run scripts/install-system-deps.sh")
    proc = subprocess.run(args, cwd=cwd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise image_error(
            "image.apt_failed", f"{' '.join(args[:3])} failed: {proc.stderr.strip()[-500:]}", command=args
        )
    return proc.stdout


def kernel_package() -> str:
    """The `linux-image-6.1.0-*-amd64` package that `linux-image-amd64` depends on."""
    out = _run(["apt-cache", "depends", KERNEL_META])
    for line in out.splitlines():
        m = _KERNEL_PKG.search(line)
        if "Depends:" in line and m:
            return m.group(0)
    raise image_error("image.kernel_not_found", f"{KERNEL_META} depends on no linux-image-*-amd64 package")


def kernel_release(package: str) -> str:
    m = _KERNEL_PKG.fullmatch(package)
    if m is None:
        raise image_error("image.kernel_not_found", f"not a kernel package name: {package}")
    return m.group(1)


def resolve(names: list[str]) -> list[Package]:
    """Candidate versions from apt's lists (one `apt-cache policy` call)."""
    out = _run(["apt-cache", "policy", *names])
    versions: dict[str, str] = {}
    current = ""
    for line in out.splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            current = line[:-1]
        elif line.strip().startswith("Candidate:") and current:
            versions[current] = line.split(":", 1)[1].strip()
    missing = [n for n in names if versions.get(n, "(none)") == "(none)"]
    if missing:
        raise image_error(
            "image.package_unavailable",
            f"apt has no candidate for {', '.join(missing)} (run apt-get update)",
            packages=missing,
        )
    return [Package(n, versions[n]) for n in names]


def deb_path(cache: Path, pkg: Package) -> Path:
    safe = pkg.version.replace(":", "%3a")
    for arch in ("amd64", "all"):
        path = cache / f"{pkg.name}_{safe}_{arch}.deb"
        if path.exists():
            return path
    return cache / f"{pkg.name}_{safe}_amd64.deb"


def download(cache: Path, pkgs: list[Package]) -> list[Path]:
    """`apt-get download name=version` for what is not cached yet; returns the .deb paths."""
    cache.mkdir(parents=True, exist_ok=True)
    want = [p for p in pkgs if not deb_path(cache, p).exists()]
    if want:
        _run(["apt-get", "download", "-q", *[f"{p.name}={p.version}" for p in want]], cwd=cache)
    paths = [deb_path(cache, p) for p in pkgs]
    absent = [str(p) for p in paths if not p.exists()]
    if absent:
        raise image_error("image.download_failed", f"apt-get download left no file for {absent}")
    return paths


def extract(deb: Path, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    _run(["dpkg-deb", "-x", str(deb), str(dest)])
