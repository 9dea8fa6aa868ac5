"""Image builder parts: deterministic cpio, vmlinux from an XZ bzImage, modinfo and modules.dep, manifest."""

from __future__ import annotations

import io
import lzma
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cubeaccel.images import cpio, kernel
from cubeaccel.images.manifest import Artifact, Manifest, sha256_file
from cubeaccel.model.contract import CompatibilityContract, freeze
from cubeaccel.model.template_spec import GuestKernel, ModulesImg
from cubeaccel.protocol.errors import CubeError
from cubeaccel.wire.shim_spec import ShimSpec, parse_spec
from cubeaccel.wire.templates import load_template

REL = "6.1.0-99-amd64"
EXAMPLES = Path(__file__).resolve().parents[2] / "src" / "cubeaccel" / "examples" / "templates"


def _tree(root: Path, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)


@settings(max_examples=25, deadline=None)
@given(
    st.dictionaries(st.from_regex(r"[a-z]{1,6}(/[a-z]{1,6}){0,2}", fullmatch=True), st.binary(max_size=300), max_size=6)
)
def test_cpio_is_deterministic_and_readable_by_cpio(
    tmp_path_factory: pytest.TempPathFactory, files: dict[str, bytes]
) -> None:
    files = {k: v for k, v in files.items() if not any(o != k and o.startswith(k + "/") for o in files)}
    root = tmp_path_factory.mktemp("tree")
    _tree(root, files)
    a, b = io.BytesIO(), io.BytesIO()
    cpio.write_tree(root, a, prefix="x/y")
    cpio.write_tree(root, b, prefix="x/y")
    assert a.getvalue() == b.getvalue()
    if shutil.which("cpio"):
        listing = subprocess.run(["cpio", "-it", "--quiet"], input=a.getvalue(), capture_output=True, check=True)
        names = set(listing.stdout.decode().split())
        assert {f"x/y/{k}" for k in files} <= names and "x" in names


def test_vmlinux_is_the_xz_payload_of_the_bzimage(tmp_path: Path) -> None:
    elf = b"\x7fELF" + b"\x02" * 5000
    (tmp_path / "vmlinuz").write_bytes(b"MZ setup code" * 10 + lzma.compress(elf, format=lzma.FORMAT_XZ) + b"\0" * 9)
    kernel.extract_vmlinux(tmp_path / "vmlinuz", tmp_path / "vmlinux")
    assert (tmp_path / "vmlinux").read_bytes() == elf
    (tmp_path / "gz").write_bytes(b"MZ" + b"\x1f\x8b" * 100)
    with pytest.raises(CubeError) as e:
        kernel.extract_vmlinux(tmp_path / "gz", tmp_path / "x")
    assert e.value.code == "image.kernel_format"


def _ko(deps: str, vermagic: str = f"{REL} SMP preempt mod_unload modversions ") -> bytes:
    return b"\x7fELF junk\0license=GPL\0depends=" + deps.encode() + b"\0vermagic=" + vermagic.encode() + b"\0"


def _policy_modules() -> dict[str, bytes]:
    """The home's RAM disk and the sandbox policy's modules (NIC, scratch disk, 9p), dependency-free stand-ins."""
    names = ("brd", "virtio_net", "virtio_blk", "crc32c_generic", "ext4", "9pnet_virtio", "9p")
    return {f"policy/{m}.ko": _ko("") for m in names}


def test_modules_img_holds_the_closure_with_a_modules_dep(tmp_path: Path) -> None:
    moddir = tmp_path / "lib/modules" / REL / "kernel"
    _tree(
        moddir,
        {
            "virtio/virtio.ko": _ko(""),
            "virtio/virtio_ring.ko": _ko("virtio"),
            "virtio/virtio_pci.ko": _ko("virtio_ring,virtio"),
            "char/virtio_console.ko": _ko("virtio_ring"),
            "uio/uio.ko": _ko(""),
            "uio/uio_pci_generic.ko": _ko("uio"),
            "pci/pci-stub.ko": _ko(""),
            "unrelated/big.ko": _ko(""),
            **_policy_modules(),
        },
    )
    mods = kernel.build_modules_img(tmp_path, REL, tmp_path / "work", tmp_path / "modules.img")
    assert mods == sorted(
        [
            *("virtio", "virtio_ring", "virtio_pci", "virtio_console", "uio", "uio_pci_generic", "pci_stub"),
            *("brd", "virtio_net", "virtio_blk", "crc32c_generic", "ext4", "9pnet_virtio", "9p"),
        ]
    )
    dep = (tmp_path / "work/modules/modules.dep").read_text()
    assert "kernel/virtio/virtio_pci.ko: kernel/virtio/virtio_ring.ko kernel/virtio/virtio.ko" in dep
    assert "big.ko" not in dep


def test_modules_dep_lists_dependents_before_what_they_need(tmp_path: Path) -> None:
    # Debian 6.1.0-57: virtio itself needs virtio_ring; modprobe loads the list from its end.
    moddir = tmp_path / "lib/modules" / REL / "kernel"
    _tree(
        moddir,
        {
            "virtio/virtio.ko": _ko("virtio_ring"),
            "virtio/virtio_ring.ko": _ko(""),
            "virtio/virtio_pci.ko": _ko("virtio_pci_modern_dev,virtio_ring,virtio"),
            "virtio/virtio_pci_modern_dev.ko": _ko("virtio"),
            "char/virtio_console.ko": _ko("virtio,virtio_ring"),
            "uio/uio_pci_generic.ko": _ko(""),
            "pci/pci-stub.ko": _ko(""),
            **_policy_modules(),
        },
    )
    kernel.build_modules_img(tmp_path, REL, tmp_path / "work", tmp_path / "m.img")
    lines = dict(
        line.split(": ", 1) for line in (tmp_path / "work/modules/modules.dep").read_text().splitlines() if ": " in line
    )
    order = [p.rsplit("/", 1)[1][:-3] for p in lines["kernel/virtio/virtio_pci.ko"].split()]
    assert order == ["virtio_pci_modern_dev", "virtio", "virtio_ring"]


def test_a_module_built_for_another_kernel_fails_the_build(tmp_path: Path) -> None:
    moddir = tmp_path / "lib/modules" / REL / "kernel"
    _tree(
        moddir,
        {
            "virtio/virtio_pci.ko": _ko("", vermagic="6.1.0-98-amd64 SMP "),
            "char/virtio_console.ko": _ko(""),
            "uio/uio_pci_generic.ko": _ko(""),
            "pci/pci-stub.ko": _ko(""),
            **_policy_modules(),
        },
    )
    with pytest.raises(CubeError) as e:
        kernel.build_modules_img(tmp_path, REL, tmp_path / "work", tmp_path / "m.img")
    assert e.value.code == "image.module_vermagic" and e.value.layer == "modules_img"


def test_manifest_round_trips_and_detects_a_changed_artifact(tmp_path: Path) -> None:
    for name in ("vmlinux", "modules.img", "rootfs.cpio", "initrd.img"):
        (tmp_path / name).write_bytes(name.encode())

    def art(n: str) -> Artifact:
        return Artifact(n, sha256_file(tmp_path / n))

    m = Manifest(
        key="k",
        kernel_package=f"linux-image-{REL}",
        kernel_package_version="6.1.1-1",
        kernel_release=REL,
        vmlinuz_sha256="sha256:00",
        vmlinux=art("vmlinux"),
        modules_img=art("modules.img"),
        modules=("virtio",),
        rootfs=art("rootfs.cpio"),
        initrd=art("initrd.img"),
        packages=(),
        agent_sha256="sha256:11",
        cmdline="console=ttyS0",
        directory=tmp_path,
    )
    loaded = Manifest.load(m.save())
    assert loaded == m and loaded.image_digest.startswith("sha256:") and loaded.verify() == []
    (tmp_path / "rootfs.cpio").write_bytes(b"tampered")
    assert loaded.verify() == ["rootfs.cpio"]
    (tmp_path / "manifest.json").write_text("{}")
    with pytest.raises(CubeError) as e:
        Manifest.load(tmp_path / "manifest.json")
    assert e.value.code == "image.manifest_invalid"


def _manifest(tmp_path: Path) -> Manifest:
    for name in ("vmlinux", "modules.img", "rootfs.cpio", "initrd.img"):
        (tmp_path / name).write_bytes(name.encode())

    def art(n: str) -> Artifact:
        return Artifact(n, sha256_file(tmp_path / n))

    m = Manifest(
        key="k",
        kernel_package=f"linux-image-{REL}",
        kernel_package_version="1",
        kernel_release=REL,
        vmlinuz_sha256="sha256:aa",
        vmlinux=art("vmlinux"),
        modules_img=art("modules.img"),
        modules=(),
        rootfs=art("rootfs.cpio"),
        initrd=art("initrd.img"),
        packages=(),
        agent_sha256="sha256:11",
        cmdline="console=ttyS0",
        directory=tmp_path,
    )
    m.save()
    return m


def _pinned(m: Manifest, **over: object) -> CompatibilityContract:
    """A frozen contract pinning `m`'s image, kernel (by its vmlinuz digest) and modules.img, with `over` replaced."""
    t = load_template(EXAMPLES / "edu-demo.yaml")
    pins = {
        "guest_image_digest": m.image_digest,
        "guest_kernel": GuestKernel(REL, "sha256:aa"),
        "modules_img": ModulesImg(REL, m.modules_img.sha256),
    }
    return freeze(replace(t, **{**pins, **over}))  # type: ignore[arg-type]


def test_contract_pins_are_compared_with_the_built_image(tmp_path: Path) -> None:
    from cubeaccel.shim.image_check import image_mismatches

    m = _manifest(tmp_path)
    assert image_mismatches(_pinned(m), m) == [] and image_mismatches(None, m) == []
    bad = _pinned(
        m, guest_kernel=GuestKernel("6.1.0-57-amd64", "sha256:aa"), modules_img=ModulesImg(REL, "sha256:" + "0" * 64)
    )
    assert [(x["layer"], x["code"]) for x in image_mismatches(bad, m)] == [
        ("guest_kernel", "compat.guest_kernel_mismatch"),
        ("modules_img", "compat.modules_img_mismatch"),
    ]


def test_enforced_image_mismatch_fails_before_any_vm_starts(tmp_path: Path) -> None:
    import json

    from cubeaccel.shim.process import run_shim

    m = _manifest(tmp_path)
    spec = parse_spec(
        {
            "sandbox_id": "sb-x",
            "devices": [],
            "memory_mib": 256,
            "contract": _pinned(m, modules_img=ModulesImg(REL, "sha256:" + "0" * 64)).to_json(),
            "image_check": "enforce",
            "image_manifest": str(m.directory / "manifest.json"),
            "state_dir": str(tmp_path / "st"),
            "report": {"file": str(tmp_path / "r.jsonl")},
        }
    )
    assert run_shim(spec) == 1
    reports = [json.loads(x) for x in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in reports] == ["attach_failed", "shim_exiting"]
    assert reports[0]["details"]["layer"] == "modules_img"


def test_image_show_prints_the_latest_manifest_and_flags_corruption(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    show = [
        sys.executable,
        "-c",
        "from cubeaccel.cli import main; main()",
        "image",
        "show",
        "--cache-dir",
        str(tmp_path),
    ]
    assert subprocess.run(show, capture_output=True, text=True).returncode == 1  # nothing built yet
    img = tmp_path / "images" / "k"
    img.mkdir(parents=True)
    m = _manifest(img)
    (tmp_path / "images" / "latest").write_text("k\n")
    out = json.loads(subprocess.run(show, capture_output=True, text=True, check=True).stdout)
    assert out["intact"] and out["image_digest"] == m.image_digest and out["kernel"]["release"] == REL
    (img / "vmlinux").write_bytes(b"changed")
    out = json.loads(subprocess.run(show, capture_output=True, text=True, check=True).stdout)
    assert not out["intact"] and out["corrupt"] == ["vmlinux"]


# --- which image the shim boots ---------------------------------------------------------------------------


def _cached(cache: Path, key: str) -> Manifest:
    """An image in the cache layout `cubeaccel image build` writes, with artifacts unique to `key`."""
    d = cache / "images" / key
    d.mkdir(parents=True)
    for name in ("vmlinux", "modules.img", "rootfs.cpio", "initrd.img"):
        (d / name).write_bytes(f"{key}:{name}".encode())

    def art(n: str) -> Artifact:
        return Artifact(n, sha256_file(d / n))

    m = Manifest(
        key=key,
        kernel_package=f"linux-image-{REL}",
        kernel_package_version="1",
        kernel_release=REL,
        vmlinuz_sha256="sha256:" + "a" * 64,
        vmlinux=art("vmlinux"),
        modules_img=art("modules.img"),
        modules=(),
        rootfs=art("rootfs.cpio"),
        initrd=art("initrd.img"),
        packages=(),
        agent_sha256="sha256:11",
        cmdline="console=ttyS0",
        directory=d,
    )
    m.save()
    return m


EDU_DEVICE = {
    "device_id": "emulated-0000:e0:00.0",
    "driver": "edu",
    "properties": {},
    "vendor_id": "1234",
    "device_id_hex": "11e8",
}


def _shim_spec(tmp_path: Path, **fields: object) -> ShimSpec:

    return parse_spec(
        {
            "sandbox_id": "sb-img",
            "devices": [],
            "memory_mib": 256,
            "state_dir": str(tmp_path / "st"),
            "report": {"file": str(tmp_path / "r.jsonl")},
            **fields,
        }
    )


def _reports(tmp_path: Path) -> list[dict[str, object]]:
    import json

    return [json.loads(x) for x in (tmp_path / "r.jsonl").read_text().splitlines()]


def test_the_shim_boots_the_image_named_by_digest_not_the_last_one_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from cubeaccel.shim.process import Shim

    monkeypatch.setenv("CUBEACCEL_CACHE_DIR", str(tmp_path / "cache"))
    pinned, newer = _cached(tmp_path / "cache", "old"), _cached(tmp_path / "cache", "new")
    (tmp_path / "cache" / "images" / "latest").write_text("new\n")
    chosen = Shim(_shim_spec(tmp_path, image_digest=pinned.image_digest))._manifest()
    assert chosen.key == "old" and chosen.image_digest == pinned.image_digest != newer.image_digest


@pytest.mark.parametrize(
    ("fields", "code", "layer"),
    [
        ({"image_digest": "sha256:" + "9" * 64}, "shim.image_not_found", "template"),
        ({}, "shim.no_image", "template"),  # no digest named: never "the latest"
        ({"hotplug": False, "devices": [EDU_DEVICE]}, "shim.coldplug_unsupported", "backend"),  # a device to plug
    ],
)
def test_the_shim_refuses_before_any_vm_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fields: dict[str, object], code: str, layer: str
) -> None:
    from cubeaccel.shim.process import run_shim

    monkeypatch.setenv("CUBEACCEL_CACHE_DIR", str(tmp_path / "cache"))
    _cached(tmp_path / "cache", "only")
    (tmp_path / "cache" / "images" / "latest").write_text("only\n")
    assert run_shim(_shim_spec(tmp_path, **fields)) == 1
    reports = _reports(tmp_path)
    assert [r["kind"] for r in reports] == ["attach_failed", "shim_exiting"]
    details = reports[0]["details"]
    assert isinstance(details, dict) and (details["reason"], details["layer"]) == (code, layer)


def test_an_image_digest_in_the_spec_must_be_a_digest(tmp_path: Path) -> None:
    with pytest.raises(CubeError) as e:
        _shim_spec(tmp_path, image_digest="latest")
    assert (e.value.code, e.value.details["field"]) == ("shim.invalid_spec", "image_digest")


def test_the_node_reports_its_intact_images_newest_first_and_skips_a_corrupt_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    from cubeaccel.cubelet.process_shim import ProcessShimDriver

    monkeypatch.setenv("CUBEACCEL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CUBEACCEL_QEMU", "/usr/bin/qemu-system-x86_64")
    old, new, bad = (_cached(tmp_path / "cache", k) for k in ("old", "new", "bad"))
    for i, m in enumerate((old, bad, new)):
        os.utime(m.directory / "manifest.json", (1000 + i, 1000 + i))
    (bad.directory / "rootfs.cpio").write_bytes(b"tampered")
    driver = ProcessShimDriver(tmp_path / "state")
    facts = driver.node_facts()
    assert [f.digest for f in facts.guest_images] == [new.image_digest, old.image_digest]
    assert facts.guest_images[0] == new.fact() and facts.default_image == new.image_digest
    assert facts.guest_images[0].kernel_digests == (new.vmlinux.sha256, "sha256:" + "a" * 64)
    assert facts.hotplug == ("pcie-root-port-acpi",)
    (new.directory / "vmlinux").write_bytes(b"changed, and longer")  # a change after the first hash is seen
    assert [f.digest for f in driver.node_facts().guest_images] == [old.image_digest]


def test_an_unpinned_sandbox_boots_the_newest_validation_image_even_when_a_userland_or_gpu_one_is_newer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A userland or GPU initrd does not unpack in a 256 MiB guest ("Initramfs unpacking failed: write error"):
    the node's default stays the validation image, whatever was built last (`up` builds the userland one)."""
    import os

    from cubeaccel.cubelet.process_shim import ProcessShimDriver

    monkeypatch.setenv("CUBEACCEL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CUBEACCEL_QEMU", "/usr/bin/qemu-system-x86_64")
    images = [_cached(tmp_path / "cache", k) for k in ("0ld", "v4l1d", "userland-f00d", "userland-nvidia-beef")]
    for i, m in enumerate(images):
        os.utime(m.directory / "manifest.json", (1000 + i, 1000 + i))
    facts = ProcessShimDriver(tmp_path / "state").node_facts()
    assert facts.default_image == images[1].image_digest  # the newest validation image
    assert {f.digest for f in facts.guest_images} == {m.image_digest for m in images}  # all still advertised


def test_a_node_without_images_or_qemu_reports_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from cubeaccel.cubelet.process_shim import ProcessShimDriver

    monkeypatch.setenv("CUBEACCEL_CACHE_DIR", str(tmp_path / "empty"))
    monkeypatch.setenv("CUBEACCEL_QEMU", "")
    monkeypatch.setenv("PATH", str(tmp_path))
    facts = ProcessShimDriver(tmp_path / "state").node_facts()
    assert (facts.guest_images, facts.hotplug, facts.default_image) == ((), (), None)
