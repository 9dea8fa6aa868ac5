"""The userland flavour's recipe, without building an image: its package list resolves in apt and is closed under
the library dependencies of what it ships; the flavour is its own image (key, pointer, pruning group); the build's
configuration steps do what the maintainer scripts would.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from cubeaccel.backends.scrub_methods import EDU_REGISTERS
from cubeaccel.cubelet.scrub import ProcessScrubRunner
from cubeaccel.images import packages, rootfs
from cubeaccel.images.builder import FLAVOURS, agent_digest, flavour_named, image_label, prune
from cubeaccel.images.cpio import write_tree
from cubeaccel.images.flavour import VALIDATION
from cubeaccel.images.manifest import Artifact, Manifest
from cubeaccel.images.nvidia import NVIDIA
from cubeaccel.images.userland import (
    BASE_USERLAND,
    CA_BUNDLE,
    USERLAND,
    USERLAND_LIBRARIES,
    USERLAND_TOOLS,
    before_prune,
    check_base,
    install,
)
from cubeaccel.protocol.errors import CubeError

needs_apt = pytest.mark.skipif(shutil.which("apt-cache") is None, reason="apt-cache missing (not a Debian host)")
# Dependencies the userland does without: interpreters and data its C tools never load (git's perl helpers stay
# unusable: docs/images.md), packages only maintainer scripts use, and the python3 metapackages (the image links
# /usr/bin/python3 itself).
NOT_NEEDED = {
    "perl",
    "liberror-perl",
    "git-man",
    "openssl",
    "install-info",
    "init-system-helpers",
    "libpam-modules-bin",
    "libpam-runtime",
    "readline-common",
    "python3",
    "python3-lib2to3",
    "python3.11",
    "media-types",
    "tzdata",
    "netbase",
    "sensible-utils",
    "debconf",
    "base-files",
    "dpkg",
    "gcc-12-base",
}


@needs_apt
def test_the_userland_package_list_resolves_to_exact_versions() -> None:
    names = [*rootfs.ROOTFS_PACKAGES, *USERLAND.packages]
    resolved = packages.resolve(list(dict.fromkeys(names)))
    assert {p.name for p in resolved} == set(names)
    assert all(p.version and p.version != "(none)" for p in resolved)


@needs_apt
def test_the_userland_package_list_holds_every_library_its_packages_depend_on() -> None:
    """Every `Depends`/`PreDepends` of a shipped package is shipped, or deliberately left out (NOT_NEEDED)."""
    shipped = set(rootfs.ROOTFS_PACKAGES) | set(USERLAND.packages)
    out = subprocess.run(
        ["apt-cache", "depends", "--no-recommends", "--no-suggests", "--no-conflicts", "--no-breaks",
         "--no-replaces", "--no-enhances", *sorted(shipped)],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    missing: dict[str, set[str]] = {}
    current = ""
    alternative = False
    for line in out.splitlines():
        if not line.startswith(" "):
            current, alternative = line.strip(), False
            continue
        stripped = line.strip()
        is_alt = stripped.startswith("|")
        kind, _, dep = stripped.lstrip("|").partition(": ")
        if kind not in ("Depends", "PreDepends") or dep.startswith("<"):
            alternative = is_alt
            continue
        if not alternative and dep not in shipped and dep not in NOT_NEEDED:
            missing.setdefault(current, set()).add(dep)
        alternative = is_alt  # the next line is an alternative to this one: the first sufficed
    assert not missing, f"add these to USERLAND_LIBRARIES (or NOT_NEEDED, with the reason): {missing}"


def test_the_tools_and_libraries_are_separate_lists_without_repeats() -> None:
    assert len(set(USERLAND_TOOLS)) == len(USERLAND_TOOLS) and len(set(USERLAND_LIBRARIES)) == len(USERLAND_LIBRARIES)
    assert not set(USERLAND_TOOLS) & set(USERLAND_LIBRARIES)
    assert {"git", "curl", "sudo", "ncurses-bin", "python3-pip", "procps", "findutils", "gawk"} <= set(USERLAND_TOOLS)


def test_each_flavour_and_stack_has_its_own_label_and_an_unknown_flavour_is_refused() -> None:
    assert image_label() == "" and image_label(VALIDATION, NVIDIA) == "nvidia"
    assert image_label(USERLAND) == "userland" and image_label(USERLAND, NVIDIA) == "userland-nvidia"
    assert flavour_named(None) is VALIDATION and flavour_named("userland") is USERLAND
    assert sorted(FLAVOURS) == ["userland", "validation"]
    with pytest.raises(CubeError) as e:
        flavour_named("full")
    assert (e.value.code, e.value.status) == ("image.flavour_unknown", 422)
    assert e.value.details["known"] == ["userland", "validation"]


def test_pruning_one_label_never_removes_another_labels_images(tmp_path: Path) -> None:
    names = ["0123456789abcdef", "nvidia-0123456789abcdef", "userland-0123456789abcdef"]
    names += [f"userland-{i:016x}" for i in range(1, 4)] + ["userland-nvidia-0123456789abcdef"]
    for n in names:
        (tmp_path / n).mkdir()
    removed = prune(tmp_path, keep=1, flavour="userland")
    assert len(removed) == 3 and all(r.startswith("userland-") and "nvidia" not in r for r in removed)
    left = {p.name for p in tmp_path.iterdir()}
    assert {"0123456789abcdef", "nvidia-0123456789abcdef", "userland-nvidia-0123456789abcdef"} <= left


def test_the_ca_bundle_is_every_certificate_in_sorted_order_and_survives_the_prune(tmp_path: Path) -> None:
    mozilla = tmp_path / "usr/share/ca-certificates/mozilla"
    mozilla.mkdir(parents=True)
    (mozilla / "B.crt").write_text("-----B-----\n")
    (mozilla / "A.crt").write_text("-----A-----")
    before_prune(tmp_path)
    rootfs.prune(tmp_path, USERLAND.keep, USERLAND.keep_dynload)
    assert (tmp_path / CA_BUNDLE).read_text() == "-----A-----\n-----B-----\n"
    assert not (tmp_path / "usr/share").exists()  # the rest of what the prune takes is still taken


def test_a_userland_without_certificates_fails_the_build(tmp_path: Path) -> None:
    with pytest.raises(CubeError) as e:
        before_prune(tmp_path)
    assert e.value.code == "image.userland_incomplete"


def test_the_prune_spares_the_kept_python_modules_only_for_the_flavour_that_keeps_them(tmp_path: Path) -> None:
    for root in (tmp_path / "v", tmp_path / "u"):
        (root / "usr/lib/python3.11/sqlite3").mkdir(parents=True)
        (root / "usr/lib/python3.11/lib-dynload").mkdir(parents=True)
        (root / "usr/lib/python3.11/lib-dynload/_sqlite3.cpython-311-x86_64-linux-gnu.so").write_bytes(b"")
        (root / "usr/libexec/sudo").mkdir(parents=True)
    rootfs.prune(tmp_path / "v")
    rootfs.prune(tmp_path / "u", USERLAND.keep, USERLAND.keep_dynload)
    for rel in ("usr/lib/python3.11/sqlite3", "usr/libexec/sudo"):
        assert not (tmp_path / "v" / rel).exists() and (tmp_path / "u" / rel).is_dir()
    assert [p.name.split(".")[0] for p in (tmp_path / "u/usr/lib/python3.11/lib-dynload").iterdir()] == ["_sqlite3"]
    assert not any((tmp_path / "v/usr/lib/python3.11/lib-dynload").iterdir())


def test_cpio_keeps_the_setuid_bit_only_where_the_flavour_names_it(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "usr/bin").mkdir(parents=True)
    for name in ("sudo", "other"):
        (root / "usr/bin" / name).write_bytes(b"x")
        (root / "usr/bin" / name).chmod(0o4755)
    out = tmp_path / "a.cpio"
    with out.open("wb") as f:
        write_tree(root, f, modes=USERLAND.modes)
    listing = subprocess.run(["cpio", "-itv"], stdin=out.open("rb"), capture_output=True, text=True).stdout
    modes = {line.split()[-1]: line.split()[0] for line in listing.splitlines() if "usr/bin/" in line}
    assert modes == {"usr/bin/sudo": "-rwsr-xr-x", "usr/bin/other": "-rwxr-xr-x"}


def _manifest(directory: Path, flavour: str, agent: str) -> Manifest:
    art = Artifact("x", "sha256:" + hashlib.sha256(directory.name.encode()).hexdigest())
    directory.mkdir(parents=True)
    m = Manifest(
        key=directory.name, kernel_package="linux-image-6.1.0-57-amd64", kernel_package_version="6.1.192-3",
        kernel_release="6.1.0-57-amd64", vmlinuz_sha256="", vmlinux=art, modules_img=art, modules=(), rootfs=art,
        initrd=art, packages=(), agent_sha256=agent, cmdline="", directory=directory, flavour=flavour,
    )  # fmt: skip
    m.save()
    return m


def test_a_cpu_scrub_vm_boots_the_validation_flavour_even_when_a_userland_image_is_newer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUBEACCEL_CACHE_DIR", str(tmp_path / "cache"))
    images = tmp_path / "cache" / "images"
    validation = _manifest(images / "0123456789abcdef", "validation", agent_digest())
    userland = _manifest(images / "userland-0123456789abcdef", "userland", agent_digest())
    old = time.time() - 60
    os.utime(validation.directory / "manifest.json", (old, old))  # the userland image is the newest
    assert Manifest.load(userland.directory / "manifest.json").flavour == "userland"
    runner = ProcessScrubRunner(tmp_path / "state")
    assert runner.image(EDU_REGISTERS).digest == validation.image_digest
    shutil.rmtree(validation.directory)
    assert runner.image(EDU_REGISTERS).digest == userland.image_digest  # the only one that carries this agent


def test_an_image_built_under_a_private_umask_is_readable_by_the_vmms(tmp_path: Path) -> None:
    """Confined VMMs run as uids of their own: a build under a Cubelet's or CLI's 0077 umask (files 0600, as a
    CI run left the userland + NVIDIA image: "could not open kernel file … Permission denied") is made 0755/0644."""
    from cubeaccel.images.builder import readable_by_vmms

    d = tmp_path / "images" / "userland-nvidia-x"
    d.mkdir(parents=True, mode=0o700)
    (d / "vmlinux").write_bytes(b"k")
    (d / "vmlinux").chmod(0o600)
    readable_by_vmms(d)
    assert (d.stat().st_mode & 0o777, (d / "vmlinux").stat().st_mode & 0o777) == (0o755, 0o644)


def _fake_userland(root: Path) -> None:
    """Every file BASE_USERLAND names, as the packages would leave it (links as the build makes them)."""
    for rel in BASE_USERLAND.values():
        if rel == "usr/share/git-core/templates":
            (root / rel).mkdir(parents=True, exist_ok=True)
            (root / rel / "description").write_text("x\n")
        elif rel not in ("usr/bin/awk", "usr/bin/python"):
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_text("x\n")
    (root / "usr/bin/gawk").write_text("x\n")
    (root / "usr/bin/python3").unlink()
    (root / "usr/bin/python3.11").write_text("x\n")
    (root / "usr/bin/python3").symlink_to("python3.11")


def test_the_userland_build_keeps_git_daemon_which_e2bs_own_git_tests_start_as_their_remote(tmp_path: Path) -> None:
    """The build's drops and its configuration leave every part of E2B base's userland in place."""
    _fake_userland(tmp_path)
    install(tmp_path)
    assert (tmp_path / "usr/lib/git-core/git-daemon").is_file()
    assert not (tmp_path / "usr/lib/git-core/git-http-backend").exists()  # still dropped: a server nobody runs
    check_base(tmp_path)


def test_an_image_missing_part_of_the_base_userland_fails_its_build_naming_the_part(tmp_path: Path) -> None:
    _fake_userland(tmp_path)
    (tmp_path / "usr/bin/awk").symlink_to("gawk")
    (tmp_path / "usr/bin/python").symlink_to("/usr/bin/python3")  # absolute: resolved inside the rootfs
    check_base(tmp_path)
    (tmp_path / "usr/bin/xargs").unlink()
    shutil.rmtree(tmp_path / "usr/share/git-core")
    (tmp_path / "usr/bin/gawk").unlink()  # a dangling link counts as missing
    with pytest.raises(CubeError) as e:
        check_base(tmp_path)
    assert e.value.code == "image.userland_incomplete"
    assert e.value.details["missing"] == ["xargs", "awk", "git init's templates"]


def _deb(out: Path, name: str, files: dict[str, str]) -> Path:
    tree = out / f"{name}-tree"
    (tree / "DEBIAN").mkdir(parents=True)
    (tree / "DEBIAN/control").write_text(
        f"Package: {name}\nVersion: 1\nArchitecture: all\nMaintainer: t <t@t>\nDescription: t\n"
    )
    for rel, text in files.items():
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_text(text)
    subprocess.run(["dpkg-deb", "--root-owner-group", "-b", str(tree), str(out / f"{name}.deb")], check=True,
                   capture_output=True)  # fmt: skip
    return out / f"{name}.deb"


@pytest.mark.skipif(shutil.which("dpkg-deb") is None, reason="dpkg-deb missing (not a Debian host)")
def test_a_vendor_stack_drops_its_own_documentation_and_keeps_the_userlands_files_there(tmp_path: Path) -> None:
    """A GPU image adds NVIDIA's stack to the userland: the stack's usr/share goes, git's templates stay."""
    root = tmp_path / "root"
    (root / "usr/share/git-core/templates").mkdir(parents=True)
    (root / "usr/share/git-core/templates/description").write_text("kept\n")
    debs = [
        _deb(tmp_path, "libcuda1", {"usr/lib/libcuda.so.1": "elf", "usr/share/doc/libcuda1/copyright": "c"}),
        _deb(tmp_path, "nvidia-smi", {"usr/bin/nvidia-smi": "elf", "usr/share/git-core/templates/x": "added"}),
    ]
    rootfs.extract_adding(debs, root, drop=("usr/share", "usr/lib/gbm"))
    assert (root / "usr/lib/libcuda.so.1").is_file() and (root / "usr/bin/nvidia-smi").is_file()
    assert sorted(p.relative_to(root).as_posix() for p in (root / "usr/share").rglob("*")) == [
        "usr/share/git-core",
        "usr/share/git-core/templates",
        "usr/share/git-core/templates/description",
    ]
