"""Holders found by scanning /proc/*/fd: against a fake proc tree and against the real /proc."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from cubeaccel.host.pci import procfs
from cubeaccel.host.pci.base import Holder
from tests.support.holder_proc import holding


def _fake_proc(root: Path, pid: int, comm: str, fds: dict[int, str]) -> None:
    (root / str(pid) / "fd").mkdir(parents=True)
    (root / str(pid) / "comm").write_text(comm + "\n")
    for fd, target in fds.items():
        (root / str(pid) / "fd" / str(fd)).symlink_to(target)


def test_fake_proc_tree_holders_of_a_vfio_group_and_nvidia_nodes(tmp_path: Path) -> None:
    _fake_proc(tmp_path, 4242, "qemu-system-x86", {3: "/dev/vfio/vfio", 4: "/dev/vfio/12", 5: "/dev/null"})
    _fake_proc(tmp_path, 77, "nvidia-smi", {3: "/dev/nvidiactl", 4: "/dev/nvidia0"})
    _fake_proc(tmp_path, 99, "bash", {0: "/dev/pts/0"})
    (tmp_path / "self").mkdir()  # non-numeric entries are not processes
    (tmp_path / "1000").mkdir()  # a process that exited between listing and reading
    assert procfs.find_holders(procfs.exact(["/dev/vfio/12"]), tmp_path) == [
        Holder(4242, "qemu-system-x86", "/dev/vfio/12")
    ]
    nvidia = procfs.find_holders(procfs.glob("/dev/nvidia*"), tmp_path)
    assert nvidia == [Holder(77, "nvidia-smi", "/dev/nvidia0"), Holder(77, "nvidia-smi", "/dev/nvidiactl")]
    both = procfs.any_of(procfs.exact(["/dev/vfio/12"]), procfs.glob("/dev/nvidia[0-9]*"))
    assert [h.pid for h in procfs.find_holders(both, tmp_path)] == [77, 4242]


def test_a_missing_proc_root_is_one_unknown_holder(tmp_path: Path) -> None:
    """Fail closed: when nothing can be seen, nothing is proven free."""
    found = procfs.find_holders(procfs.glob("*"), tmp_path / "nope")
    assert len(found) == 1 and found[0].unknown and found[0].pid == 0


def test_a_process_whose_fds_cannot_be_read_is_an_unknown_holder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_proc(tmp_path, 4242, "qemu-system-x86", {4: "/dev/vfio/12"})
    _fake_proc(tmp_path, 99, "bash", {0: "/dev/pts/0"})
    _fake_proc(tmp_path, 500, "secretive", {})
    real_scandir = os.scandir

    def scandir(path: Any) -> Any:
        if str(path).endswith("/500/fd"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    found = procfs.find_holders(procfs.exact(["/dev/vfio/12"]), tmp_path)
    assert found == [
        Holder(500, "secretive", procfs.UNREADABLE, unknown=True),
        Holder(4242, "qemu-system-x86", "/dev/vfio/12"),
    ]


def test_an_fd_that_cannot_be_resolved_is_an_unknown_holder_but_a_closed_one_is_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_proc(tmp_path, 600, "racy", {3: "/dev/null", 4: "/dev/null"})
    real_readlink = os.readlink

    def readlink(path: str | os.PathLike[str]) -> str:
        if str(path).endswith("/600/fd/3"):
            raise FileNotFoundError(2, "closed meanwhile", str(path))
        return real_readlink(path)

    monkeypatch.setattr(os, "readlink", readlink)
    assert procfs.find_holders(procfs.exact(["/dev/vfio/12"]), tmp_path) == []

    def denied(path: Any) -> str:
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(os, "readlink", denied)
    assert [h.unknown for h in procfs.find_holders(procfs.exact(["/dev/vfio/12"]), tmp_path)] == [True]


def _known(holders: list[Holder]) -> list[Holder]:
    """On a shared host some processes (here: a more privileged PID 1) cannot be read: unknown, not ours."""
    return [h for h in holders if not h.unknown]


def test_real_process_holding_a_file_is_found_in_real_proc(tmp_path: Path) -> None:
    target = Path(os.path.realpath(tmp_path)) / "vfio-12"
    target.write_text("")
    assert _known(procfs.find_holders(procfs.exact([str(target)]))) == []
    with holding(target) as proc:
        found = _known(procfs.find_holders(procfs.exact([str(target)])))
        assert [(h.pid, h.path) for h in found] == [(proc.pid, str(target))]
        assert found[0].command.startswith("python")
    assert _known(procfs.find_holders(procfs.exact([str(target)]))) == []


def test_every_unknown_holder_in_real_proc_is_a_process_we_cannot_read() -> None:
    unknown = {h.pid for h in procfs.find_holders(procfs.glob("/nonexistent/*")) if h.unknown}
    for pid in unknown:
        fd_dir = Path("/proc") / str(pid) / "fd"
        try:
            for fd in os.listdir(fd_dir):
                os.readlink(fd_dir / fd)
        except FileNotFoundError:
            continue  # exited since
        except PermissionError:
            continue  # really unreadable
        raise AssertionError(f"pid {pid} was readable but reported unknown")
