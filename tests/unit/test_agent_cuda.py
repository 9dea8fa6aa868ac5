"""The ctypes path against real shared libraries compiled with gcc at test time (fake libcuda/libnvidia-ml).

The agent's real loading code runs: dlopen through --lib-path, version from the soname's target file,
cuDriverGetVersion/cuInit/cuDeviceGetCount, NVML queries, and persistence mode set only when allowed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from cubeaccel.agent.cuda import CallTimeout, call_with_deadline, load_library
from cubeaccel.agent.probes import ProbeContext
from cubeaccel.agent.report import build_report
from cubeaccel.agent.spec import parse_spec
from cubeaccel.protocol.reports import GuestReport, ProbeResult
from tests.unit.test_agent_fakes import DRIVER_VERSION, FakeGuest, compile_driver_libs

CUDA_SPEC: dict[str, Any] = {
    "libraries": [
        {"name": "libcuda.so.1", "version": DRIVER_VERSION, "layer": "userspace_driver"},
        {"name": "libnvidia-ml.so.1", "version": DRIVER_VERSION, "layer": "userspace_driver"},
    ],
    "cuda": {"version": "12.4", "min_driver_api": 12040},
}


@pytest.fixture(scope="module")
def libdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return compile_driver_libs(tmp_path_factory.mktemp("driver") / "lib")


@pytest.fixture
def ctx(tmp_path: Path, libdir: Path, monkeypatch: pytest.MonkeyPatch) -> ProbeContext:
    for key in [k for k in os.environ if k.startswith("FAKE_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("FAKE_NVML_STATE", str(tmp_path / "persistence"))
    (tmp_path / "persistence").write_text("0\n")
    FakeGuest(tmp_path / "root")
    return ProbeContext(root=tmp_path / "root", lib_dirs=(str(libdir),), cuda_timeout_s=5.0)


def by_name(report: GuestReport) -> dict[str, ProbeResult]:
    return {p.name: p for p in report.probes}


def test_libraries_load_from_lib_path_with_the_driver_version_of_their_file(ctx: ProbeContext, libdir: Path) -> None:
    report = build_report(parse_spec(CUDA_SPEC), ctx)
    assert report.libraries["libcuda.so.1"].to_json() == {
        "loaded": True,
        "path": str(libdir / f"libcuda.so.{DRIVER_VERSION}"),
        "version": DRIVER_VERSION,
        "error": None,
    }
    assert by_name(report)["library:libnvidia-ml.so.1"].found == DRIVER_VERSION


def test_cuda_driver_api_answers_version_init_and_device_count(
    ctx: ProbeContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_CUDA_COUNT", "8")
    monkeypatch.setenv("FAKE_CUDA_VERSION", "12060")
    report = build_report(parse_spec(CUDA_SPEC), ctx)
    assert report.cuda is not None
    assert report.cuda.driver_version == 12060 and report.cuda.driver_version_text == "12.6"
    assert report.cuda.init_ok is True and report.cuda.device_count == 8
    probes = by_name(report)
    assert probes["cuda:driver_version"].ok and probes["cuda:driver_version"].expected == ">= 12.4"
    assert probes["cuda:device_count"].found == "8"
    assert all(p.ok for p in report.probes), [p for p in report.probes if not p.ok]


def test_driver_older_than_the_contracts_cuda_names_cuda_runtime(
    ctx: ProbeContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_CUDA_VERSION", "12020")
    p = by_name(build_report(parse_spec(CUDA_SPEC), ctx))["cuda:driver_version"]
    assert (p.ok, p.layer, p.code, p.found) == (False, "cuda_runtime", "compat.cuda_driver_api_too_old", "12.2")


def test_cuinit_failure_is_reported_with_the_cuda_error_name(
    ctx: ProbeContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_CUDA_INIT_RC", "100")
    report = build_report(parse_spec(CUDA_SPEC), ctx)
    p = by_name(report)["cuda:init"]
    assert (p.ok, p.layer, p.code) == (False, "cuda_runtime", "compat.cuda_init_failed")
    assert report.cuda is not None and report.cuda.error == "cuInit: CUDA_ERROR_NO_DEVICE"
    assert report.cuda.device_count is None and not by_name(report)["cuda:device_count"].ok


def test_zero_cuda_devices_is_a_failure(ctx: ProbeContext, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_CUDA_COUNT", "0")
    p = by_name(build_report(parse_spec(CUDA_SPEC), ctx))["cuda:device_count"]
    assert (p.ok, p.code, p.found) == (False, "compat.cuda_no_device", "0")


def test_a_hanging_cuinit_times_out_without_blocking_the_agent(
    ctx: ProbeContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_CUDA_INIT_HANG_MS", "3000")
    quick = ProbeContext(root=ctx.root, lib_dirs=ctx.lib_dirs, cuda_timeout_s=0.2)
    start = time.monotonic()
    report = build_report(parse_spec({"cuda": {"version": "12.4"}}), quick)
    assert time.monotonic() - start < 2.0  # the 3 s cuInit is still sleeping in its daemon thread
    p = by_name(report)["cuda:init"]
    assert (p.ok, p.code) == (False, "compat.cuda_timeout")


def test_library_version_other_than_the_contracts_is_a_userspace_mismatch(ctx: ProbeContext) -> None:
    spec = parse_spec({"libraries": [{"name": "libcuda.so.1", "version": "535.161.08", "layer": "userspace_driver"}]})
    p = by_name(build_report(spec, ctx))["library:libcuda.so.1"]
    assert (p.ok, p.layer, p.code) == (False, "userspace_driver", "compat.userspace_driver_version_mismatch")
    assert (p.expected, p.found) == ("535.161.08", DRIVER_VERSION)


def test_missing_library_names_the_layer_the_contract_gave_it(ctx: ProbeContext) -> None:
    spec = parse_spec({"libraries": [{"name": "libcudart.so.12", "version": None, "layer": "cuda_runtime"}]})
    p = by_name(build_report(spec, ctx))["library:libcudart.so.12"]
    assert (p.ok, p.layer, p.code) == (False, "cuda_runtime", "compat.cuda_runtime_library_missing")
    assert "libcudart.so.12" in p.detail


def test_nvml_reports_count_name_memory_and_persistence(ctx: ProbeContext, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_NVML_COUNT", "2")
    report = build_report(parse_spec(CUDA_SPEC), ctx)
    assert report.nvml is not None
    assert report.nvml.driver_version == DRIVER_VERSION and report.nvml.device_count == 2
    assert report.nvml.devices[1].to_json() == {
        "index": 1,
        "name": "NVIDIA H100 80GB HBM3",
        "memory_total_bytes": 85520809984,
        "persistence_mode": False,
    }
    assert by_name(report)["nvml"].ok


def test_persistence_mode_is_set_only_when_the_contract_asks_and_the_caller_allows(
    ctx: ProbeContext, tmp_path: Path
) -> None:
    state = tmp_path / "persistence"
    not_asked = ProbeContext(root=ctx.root, lib_dirs=ctx.lib_dirs, set_persistence=True)
    build_report(parse_spec(CUDA_SPEC), not_asked)
    assert state.read_text() == "0\n"

    asked = parse_spec({**CUDA_SPEC, "persistence_mode": True})
    read_only = by_name(build_report(asked, ctx))["persistence_mode"]
    assert state.read_text() == "0\n"
    assert (read_only.ok, read_only.code) == (False, "compat.persistence_mode_off")
    assert "read-only" in read_only.detail

    report = build_report(asked, not_asked)
    assert state.read_text() == "1\n"
    assert by_name(report)["persistence_mode"].ok
    assert report.nvml is not None and report.nvml.devices[0].persistence_set_result == 0


def test_nvml_init_failure_is_a_userspace_driver_failure(ctx: ProbeContext, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_NVML_INIT_RC", "9")  # NVML_ERROR_DRIVER_NOT_LOADED
    p = by_name(build_report(parse_spec(CUDA_SPEC), ctx))["nvml"]
    assert (p.ok, p.layer, p.code, p.detail) == (
        False,
        "userspace_driver",
        "compat.nvml_failed",
        "nvmlInit_v2 returned 9",
    )


def test_hand_written_userspace_version_prefers_nvml_answer(ctx: ProbeContext, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_NVML_DRIVER", "550.54.14")
    spec = parse_spec({"probes": {"libraries": ["libnvidia-ml.so.1"]}, "userspace_driver": {"version": "550.54.15"}})
    p = by_name(build_report(spec, ctx))["userspace_driver"]
    assert (p.ok, p.found, p.detail) == (False, "550.54.14", "nvmlSystemGetDriverVersion")


def test_a_library_without_the_cuda_symbols_is_an_error_not_a_crash(ctx: ProbeContext, libdir: Path) -> None:
    other = ProbeContext(root=ctx.root, lib_dirs=(str(libdir.parent / "fake-cuda"),))
    Path(other.lib_dirs[0]).mkdir(exist_ok=True)
    target = Path(other.lib_dirs[0]) / "libcuda.so.1"
    if not target.exists():
        target.symlink_to(libdir / f"libnvidia-ml.so.{DRIVER_VERSION}")
    report = build_report(parse_spec({"cuda": {"version": "12.4"}}), other)
    assert report.cuda is not None and "AttributeError" in str(report.cuda.error)
    assert by_name(report)["cuda:init"].code == "compat.cuda_init_failed"


def test_unloadable_library_reports_the_dlopen_error() -> None:
    lib = load_library("libdefinitely-not-here.so.1", ("/nonexistent",))
    assert lib.handle is None and lib.error is not None and "libdefinitely-not-here.so.1" in lib.error


def test_call_with_deadline_returns_values_raises_errors_and_times_out() -> None:
    assert call_with_deadline(lambda: 41 + 1, 1.0) == 42
    with pytest.raises(ZeroDivisionError):
        call_with_deadline(lambda: 1 // 0, 1.0)
    import threading

    release = threading.Event()
    with pytest.raises(CallTimeout):
        call_with_deadline(release.wait, 0.05)
    release.set()


def test_cli_probe_through_env_lib_path_runs_the_real_loader_in_a_fresh_process(
    ctx: ProbeContext, libdir: Path, tmp_path: Path
) -> None:
    (tmp_path / "c.json").write_text(json.dumps(CUDA_SPEC))
    env = {**os.environ, "CUBE_AGENT_LIB_PATH": str(libdir), "FAKE_CUDA_COUNT": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "cubeaccel.agent", "probe", "--json", "--contract", str(tmp_path / "c.json"),
         "--root", str(ctx.root)],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    reply = json.loads(result.stdout)
    assert reply["report"]["cuda"]["device_count"] == 1
    assert reply["report"]["libraries"]["libcuda.so.1"]["version"] == DRIVER_VERSION
