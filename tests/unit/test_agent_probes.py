"""cube-agent probes against a fake guest root: facts found vs expected, and the layer each failure names."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cubeaccel.agent.probes import ProbeContext, kernel_driver_version, pci_devices
from cubeaccel.agent.report import build_report, probe_reply
from cubeaccel.agent.spec import parse_spec, version_matches
from cubeaccel.protocol.errors import CubeError
from cubeaccel.protocol.reports import GuestPciDevice, GuestReport, ProbeResult
from tests.unit.test_agent_fakes import DRIVER_VERSION, EDU, FakeGuest

NVIDIA_SPEC: dict[str, Any] = {
    "kernel_release": "6.1.0-27-amd64",
    "modules": ["nvidia", "nvidia_uvm", "nvidia-modeset"],
    "kernel_driver": {"module": "nvidia", "version": DRIVER_VERSION},
    "device_files": ["/dev/nvidia0", "/dev/nvidiactl", "/dev/nvidia-uvm"],
    "libraries": [],
    "pci": [{"vendor_id": "10de", "device_id": "2330"}, {"vendor_id": "10de", "device_id": "2331"}],
    "cuda": None,
}
EDU_SPEC: dict[str, Any] = {"kernel_release": "6.1.0-27-amd64", "pci": [{"vendor_id": EDU[0], "device_id": EDU[1]}]}


def by_name(report: GuestReport) -> dict[str, ProbeResult]:
    return {p.name: p for p in report.probes}


def test_edu_guest_reports_the_hotplugged_device_and_its_address(tmp_path: Path) -> None:
    guest = FakeGuest(tmp_path).pci("0000:00:00.0", "8086", "29c0", "0x060000").pci("0000:01:00.0", *EDU)
    report = build_report(parse_spec(EDU_SPEC), ProbeContext(root=tmp_path))
    probes = by_name(report)
    assert probes["pci"].ok and probes["pci"].found == "1234:11e8@0000:01:00.0"
    assert probes["guest_kernel"].ok and report.kernel_release == "6.1.0-27-amd64"
    assert GuestPciDevice("0000:01:00.0", "1234", "11e8", "00ff00") in report.pci_devices
    assert json.dumps(report.to_json()["pci_devices"]) == json.dumps(  # the dict code's keys, in its order
        [
            {"address": "0000:00:00.0", "vendor_id": "8086", "device_id": "29c0", "class": "060000"},
            {"address": "0000:01:00.0", "vendor_id": "1234", "device_id": "11e8", "class": "00ff00"},
        ]
    )
    assert all(p.duration_ms >= 0 for p in report.probes) and guest.root == tmp_path


def test_device_missing_from_guest_pci_tree_names_host_hardware(tmp_path: Path) -> None:
    FakeGuest(tmp_path).pci("0000:00:00.0", "8086", "29c0")
    pci = by_name(build_report(parse_spec(EDU_SPEC), ProbeContext(root=tmp_path)))["pci"]
    assert (pci.ok, pci.layer, pci.code) == (False, "host_hardware", "compat.device_not_visible_in_guest")
    assert pci.expected == "1234:11e8" and pci.found == "8086:29c0"


def test_nvidia_template_in_a_guest_without_driver_fails_at_kernel_driver_and_modules_img(tmp_path: Path) -> None:
    FakeGuest(tmp_path).pci("0000:01:00.0", "10de", "2330", "0x030200")
    report = build_report(parse_spec(NVIDIA_SPEC), ProbeContext(root=tmp_path))
    failed = {p.name: (p.layer, p.code) for p in report.probes if not p.ok}
    assert failed == {
        "module:nvidia": ("kernel_driver", "compat.kernel_driver_not_loaded"),
        "module:nvidia_uvm": ("modules_img", "compat.modules_img_module_missing"),
        "module:nvidia-modeset": ("modules_img", "compat.modules_img_module_missing"),
        "device_file:/dev/nvidia0": ("kernel_driver", "compat.kernel_driver_device_file_missing"),
        "device_file:/dev/nvidiactl": ("kernel_driver", "compat.kernel_driver_device_file_missing"),
        "device_file:/dev/nvidia-uvm": ("kernel_driver", "compat.kernel_driver_device_file_missing"),
        "kernel_driver": ("kernel_driver", "compat.kernel_driver_not_loaded"),
    }
    assert report.device_files == dict.fromkeys(NVIDIA_SPEC["device_files"], False)
    assert report.kernel_driver_version is None


def test_modprobe_failures_are_each_reported_and_successes_show_in_proc_modules(tmp_path: Path) -> None:
    guest = FakeGuest(tmp_path)
    modprobe = guest.modprobe({"nvidia": "modprobe: FATAL: Module nvidia not found in directory /lib/modules/6.1.0"})
    ctx = ProbeContext(root=tmp_path, modprobe=(modprobe,), load_modules=True)
    report = build_report(parse_spec(NVIDIA_SPEC), ctx)
    probes = by_name(report)
    assert report.module_failures == {
        "nvidia": "modprobe: FATAL: Module nvidia not found in directory /lib/modules/6.1.0"
    }
    assert probes["modprobe:nvidia"].code == "compat.modules_img_module_failed"
    assert probes["modprobe:nvidia"].layer == "modules_img"
    assert probes["modprobe:nvidia_uvm"].ok and probes["modprobe:nvidia-modeset"].ok
    assert "module:nvidia" not in probes  # its failure is the modprobe probe's, not reported twice
    assert probes["module:nvidia_uvm"].ok and probes["module:nvidia-modeset"].ok
    assert report.modules_loaded == ("nvidia_uvm", "nvidia_modeset")


def test_missing_modprobe_and_hanging_modprobe_are_failures_not_crashes(tmp_path: Path) -> None:
    FakeGuest(tmp_path)
    spec = parse_spec({"modules": ["virtio_rng"]})
    missing = build_report(spec, ProbeContext(root=tmp_path, modprobe=("/nonexistent/modprobe",), load_modules=True))
    assert missing.module_failures == {"virtio_rng": "modprobe command not found: /nonexistent/modprobe"}
    stuck = ("sh", "-c", "sleep 5; echo never", "modprobe")
    hanging = ProbeContext(root=tmp_path, modprobe=stuck, load_modules=True, modprobe_timeout_s=0.2)
    assert build_report(spec, hanging).module_failures == {"virtio_rng": "modprobe timed out after 0.2s"}


def test_healthy_nvidia_guest_passes_every_probe_with_versions_found(tmp_path: Path) -> None:
    guest = FakeGuest(tmp_path).nvidia_driver().module("nvidia_uvm").module("nvidia_modeset")
    guest.pci("0000:01:00.0", "10de", "2331", "0x030200").dev(*NVIDIA_SPEC["device_files"])
    report = build_report(parse_spec(NVIDIA_SPEC), ProbeContext(root=tmp_path))
    assert [p.name for p in report.probes if not p.ok] == []
    assert by_name(report)["kernel_driver"].found == DRIVER_VERSION
    assert by_name(report)["pci"].found == "10de:2331@0000:01:00.0"


def test_kernel_driver_version_mismatch_names_kernel_driver(tmp_path: Path) -> None:
    FakeGuest(tmp_path).nvidia_driver("535.161.08")
    kd = by_name(build_report(parse_spec(NVIDIA_SPEC), ProbeContext(root=tmp_path)))["kernel_driver"]
    assert (kd.ok, kd.code, kd.expected, kd.found) == (
        False,
        "compat.kernel_driver_version_mismatch",
        DRIVER_VERSION,
        "535.161.08",
    )


def test_kernel_driver_version_falls_back_to_proc_driver_nvidia(tmp_path: Path) -> None:
    FakeGuest(tmp_path).nvidia_driver("550.90.07")
    (tmp_path / "sys/module/nvidia/version").unlink()
    assert kernel_driver_version(ProbeContext(root=tmp_path)) == "550.90.07"


def test_guest_kernel_mismatch_names_guest_kernel(tmp_path: Path) -> None:
    FakeGuest(tmp_path).kernel("6.1.0-57-amd64")
    k = by_name(build_report(parse_spec(EDU_SPEC), ProbeContext(root=tmp_path)))["guest_kernel"]
    assert (k.ok, k.layer, k.code, k.found) == (False, "guest_kernel", "compat.guest_kernel_mismatch", "6.1.0-57-amd64")


def test_hand_written_contract_shape_accepts_prefix_versions(tmp_path: Path) -> None:
    FakeGuest(tmp_path).pci("0000:01:00.0", *EDU).module("edu")
    spec = parse_spec(
        {
            "guest_kernel": {"version": "6.1"},
            "probes": {"modules": ["edu"], "pci": [{"vendor_id": "1234", "device_id": "0x11E8"}]},
        }
    )
    report = build_report(spec, ProbeContext(root=tmp_path))
    assert [(p.name, p.ok) for p in report.probes] == [("guest_kernel", True), ("module:edu", True), ("pci", True)]


def test_builtin_module_counts_as_present(tmp_path: Path) -> None:
    FakeGuest(tmp_path)
    (tmp_path / "sys/module/virtio_pci").mkdir()
    probe = by_name(build_report(parse_spec({"modules": ["virtio-pci"]}), ProbeContext(root=tmp_path)))[
        "module:virtio-pci"
    ]
    assert probe.ok and probe.found == "built-in"


def test_unreadable_pci_tree_gives_no_devices_not_a_crash(tmp_path: Path) -> None:
    assert pci_devices(ProbeContext(root=tmp_path / "absent")) == ()


@pytest.mark.parametrize(
    "contract, where",
    [
        ([], "object"),
        ({"modules": "nvidia"}, "modules"),
        ({"modules": ["nvidia; rm -rf /"]}, "modules"),
        ({"device_files": ["/etc/shadow"]}, "device_files"),
        ({"device_files": ["/dev/../etc/shadow"]}, "device_files"),
        ({"pci": [{"vendor_id": "10de"}]}, "device_id"),
        ({"cuda": {"version": "twelve"}}, "cuda"),
        ({"libraries": [{"name": "libcuda.so.1", "layer": "host_hardware"}]}, "layer"),
        ({"persistence_mode": "yes"}, "persistence_mode"),
        ({"guest_probes": []}, "guest_probes"),
    ],
)
def test_invalid_contracts_are_refused_with_a_stable_code(contract: object, where: str) -> None:
    with pytest.raises(CubeError) as err:
        parse_spec(contract)
    assert err.value.code == "agent.invalid_contract" and err.value.layer == "template"
    assert where in err.value.message


@given(
    st.from_regex(r"[0-9]{1,2}(\.[0-9]{1,3}){0,3}", fullmatch=True),
    st.sampled_from(".-+~"),
    st.text("0123456789abc", max_size=8),
)
def test_version_prefix_matches_only_at_a_component_boundary(base: str, sep: str, rest: str) -> None:
    assert version_matches(base, base)
    assert version_matches(base, base + sep + rest)
    assert not version_matches(base, base + "7" + rest)


def test_probe_reply_of_a_frozen_contract_includes_check_guest_violations(tmp_path: Path) -> None:
    contract_mod = pytest.importorskip("cubeaccel.model.contract")
    from cubeaccel.model.template_spec import DeviceMatch, GuestKernel, KernelDriver, ModulesImg, Template

    digest = "sha256:" + "0" * 64
    template = Template(
        name="h100", version="1", accel_class="gpu", backend="vfio", devices=(DeviceMatch(0x10DE, 0x2330),),
        guest_image_digest=digest, guest_kernel=GuestKernel("6.1.0-27-amd64", digest),
        modules_img=ModulesImg("6.1.0-27-amd64", digest), memory_mib=512, pin_memory=True, hotplug=True,
        kernel_driver=KernelDriver("nvidia", DRIVER_VERSION),
    )  # fmt: skip
    frozen = contract_mod.freeze(template).to_json()
    FakeGuest(tmp_path).pci("0000:01:00.0", "10de", "2330")
    reply = probe_reply(frozen, parse_spec(frozen), ProbeContext(root=tmp_path)).to_json()
    assert reply["contract_check"] == "applied"
    violations = reply["violations"]
    assert isinstance(violations, list)
    assert {(v["layer"], v["code"]) for v in violations} == {("kernel_driver", "compat.kernel_driver_not_loaded")}
    assert reply["ok"] is False and reply["failed_layers"] == ["kernel_driver"]
    assert GuestReport.from_json(json.loads(json.dumps(reply["report"]))).kernel_release == "6.1.0-27-amd64"


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cubeaccel.agent", *args], capture_output=True, text=True, timeout=60, check=False
    )


def test_cli_probe_exit_code_is_0_when_all_pass_and_1_when_any_fails(tmp_path: Path) -> None:
    FakeGuest(tmp_path / "root").pci("0000:01:00.0", *EDU)
    good, bad = tmp_path / "edu.json", tmp_path / "nvidia.json"
    good.write_text(json.dumps(EDU_SPEC))
    bad.write_text(json.dumps(NVIDIA_SPEC))
    passed = run_cli("probe", "--contract", str(good), "--root", str(tmp_path / "root"), "--json")
    assert passed.returncode == 0, passed.stderr
    assert json.loads(passed.stdout)["ok"] is True
    failed = run_cli("probe", "--contract", str(bad), "--root", str(tmp_path / "root"))
    assert failed.returncode == 1
    assert "FAIL: layers host_hardware, kernel_driver, modules_img" in failed.stdout
    assert "compat.kernel_driver_device_file_missing" in failed.stdout


def test_cli_probe_with_a_bad_contract_exits_2_with_the_error_code(tmp_path: Path) -> None:
    (tmp_path / "c.json").write_text('{"modules": 5}')
    result = run_cli("probe", "--contract", str(tmp_path / "c.json"))
    assert result.returncode == 2
    assert json.loads(result.stderr)["error"]["code"] == "agent.invalid_contract"


def test_agent_runs_without_site_packages(tmp_path: Path) -> None:
    """The guest has python3 and our source, nothing from pip: -S drops site-packages entirely."""
    src = Path(__file__).resolve().parents[2] / "src"
    (tmp_path / "c.json").write_text(json.dumps(EDU_SPEC))
    FakeGuest(tmp_path / "root").pci("0000:01:00.0", *EDU)
    code = (
        "import sys, runpy;"
        "sys.argv = ['cube-agent', 'probe', '--json', '--contract', sys.argv[1], '--root', sys.argv[2]];"
        "runpy.run_module('cubeaccel.agent', run_name='__main__')"
    )
    result = subprocess.run(
        [sys.executable, "-S", "-c", code, str(tmp_path / "c.json"), str(tmp_path / "root")],
        env={"PYTHONPATH": str(src), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["ok"] is True
