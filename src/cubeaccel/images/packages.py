"""Debian packages as build inputs: resolve exact versions, `apt-get download` into the cache, extract.

Only apt's configured repositories are used (no other network). Exact versions are part of the image's cache key,
so a point release of the kernel or python produces a new image and a new digest.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from cubeaccel.protocol.errors import CubeError

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


@dataclass(frozen=True)
class Apt:
    """Which apt answers: the host's own configuration (no options), or a private root the builder owns.

    Vendor stacks need archive components (contrib, non-free, non-free-firmware) the host may not enable; they
    are added in a root of the builder's, never in the host's configuration."""

    options: tuple[str, ...] = ()

    def argv(self, tool: str, *args: str) -> list[str]:
        return [tool, *self.options, *args]


HOST_APT = Apt()
PRIVATE_LISTS_MAX_AGE_S = 24 * 3600  # a day-old package list still names downloadable versions


def _os_codename() -> str:
    try:
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("VERSION_CODENAME="):
                return line.split("=", 1)[1].strip().strip('"') or "bookworm"
    except OSError:
        pass
    return "bookworm"


def private_apt(root: Path, components: tuple[str, ...]) -> Apt:
    """An apt root under `root` whose sources are the host release's Debian archive with `components`; its
    package lists are fetched when missing or older than a day (the only network this builder uses)."""
    suite = _os_codename()
    keyring = "/usr/share/keyrings/debian-archive-keyring.gpg"
    comps = " ".join(components)
    sources = "".join(
        f"deb [signed-by={keyring}] {uri} {dist} {comps}\n"
        for uri, dist in (
            ("http://deb.debian.org/debian", suite),
            ("http://deb.debian.org/debian", f"{suite}-updates"),
            ("http://deb.debian.org/debian-security", f"{suite}-security"),
        )
    )
    for sub in ("lists/partial", "cache/archives/partial", "etc/sources.list.d", "etc/preferences.d"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    status = root / "status"
    if not status.exists():
        status.write_text("")
    src = root / "etc" / "sources.list"
    changed = not src.exists() or src.read_text() != sources
    if changed:
        src.write_text(sources)
    apt = Apt(
        (
            "-o", f"Dir::Etc::sourcelist={src}",
            "-o", f"Dir::Etc::sourceparts={root / 'etc' / 'sources.list.d'}",
            "-o", f"Dir::Etc::preferencesparts={root / 'etc' / 'preferences.d'}",
            "-o", f"Dir::State::Lists={root / 'lists'}",
            "-o", f"Dir::State::status={status}",
            "-o", f"Dir::Cache={root / 'cache'}",
            "-o", "APT::Sandbox::User=root",
        )
    )  # fmt: skip
    stamp = root / "lists" / ".updated"
    fresh = stamp.exists() and time.time() - stamp.stat().st_mtime < PRIVATE_LISTS_MAX_AGE_S
    if changed or not fresh:
        _run(apt.argv("apt-get", "update", "-qq"))
        stamp.touch()
    return apt


def _run(args: list[str], cwd: Path | None = None) -> str:
    if shutil.which(args[0]) is None:
        raise image_error("image.tool_missing", f"{args[0]} not found; run scripts/install-system-deps.sh")
    proc = subprocess.run(args, cwd=cwd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise image_error(
            "image.apt_failed", f"{' '.join(args[:3])} failed: {proc.stderr.strip()[-500:]}", command=args
        )
    return proc.stdout


def kernel_package(apt: Apt = HOST_APT) -> str:
    """The `linux-image-6.1.0-*-amd64` package that `linux-image-amd64` depends on."""
    out = _run(apt.argv("apt-cache", "depends", KERNEL_META))
    for line in out.splitlines():
        m = _KERNEL_PKG.search(line)
        if "Depends:" in line and m:
            return m.group(0)
    raise image_error("image.kernel_not_found", f"{KERNEL_META} depends on no linux-image-*-amd64 package")


def depends(apt: Apt, name: str) -> list[str]:
    """The packages `name` depends on directly (first alternative of each)."""
    out = _run(apt.argv("apt-cache", "depends", name))
    return [line.split(":", 1)[1].strip() for line in out.splitlines() if line.strip().startswith("Depends:")]


def kernel_release(package: str) -> str:
    m = _KERNEL_PKG.fullmatch(package)
    if m is None:
        raise image_error("image.kernel_not_found", f"not a kernel package name: {package}")
    return m.group(1)


def resolve(names: list[str], apt: Apt = HOST_APT, pinned: dict[str, str] | None = None) -> list[Package]:
    """Candidate versions from apt's lists (one `apt-cache policy` call). `pinned` maps a name to an upstream
    version (`535.261.03`): the newest Debian revision of exactly that version in the lists is taken instead."""
    versions, table = parse_policy(_run(apt.argv("apt-cache", "policy", *names)))
    for name, upstream in (pinned or {}).items():
        exact = [v for v in table.get(name, []) if upstream_version(v) == upstream]
        versions[name] = exact[0] if exact else "(none)"
    missing = [n for n in names if versions.get(n, "(none)") == "(none)"]
    if missing:
        raise image_error(
            "image.package_unavailable",
            f"apt has no candidate for {', '.join(missing)} (run apt-get update)"
            + (f"; pinned versions: {pinned}" if pinned else ""),
            packages=missing,
        )
    return [Package(n, versions[n]) for n in names]


def parse_policy(out: str) -> tuple[dict[str, str], dict[str, list[str]]]:
    """`apt-cache policy` text → (candidate per package, every listed version per package, newest first)."""
    versions: dict[str, str] = {}
    table: dict[str, list[str]] = {}
    current = ""
    for line in out.splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            current = line[:-1]
        elif line.strip().startswith("Candidate:") and current:
            versions[current] = line.split(":", 1)[1].strip()
        elif current and (m := _TABLE_ROW.match(line)):
            table.setdefault(current, []).append(m.group(1))
    return versions, table


_TABLE_ROW = re.compile(r"^ (?:\*\*\*| {3}) (\S+) \d+$")


def upstream_version(debian_version: str) -> str:
    """`535.261.03-1` → `535.261.03`; an epoch (`1:`) is dropped too."""
    v = debian_version.split(":", 1)[-1]
    return v.rsplit("-", 1)[0] if "-" in v else v


def deb_path(cache: Path, pkg: Package) -> Path:
    safe = pkg.version.replace(":", "%3a")
    for arch in ("amd64", "all"):
        path = cache / f"{pkg.name}_{safe}_{arch}.deb"
        if path.exists():
            return path
    return cache / f"{pkg.name}_{safe}_amd64.deb"


def download(cache: Path, pkgs: list[Package], apt: Apt = HOST_APT) -> list[Path]:
    """`apt-get download name=version` for what is not cached yet; returns the .deb paths."""
    cache.mkdir(parents=True, exist_ok=True)
    want = [p for p in pkgs if not deb_path(cache, p).exists()]
    if want:
        _run(apt.argv("apt-get", "download", "-q", *[f"{p.name}={p.version}" for p in want]), cwd=cache)
    paths = [deb_path(cache, p) for p in pkgs]
    absent = [str(p) for p in paths if not p.exists()]
    if absent:
        raise image_error("image.download_failed", f"apt-get download left no file for {absent}")
    return paths


def extract(deb: Path, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    _run(["dpkg-deb", "-x", str(deb), str(dest)])
