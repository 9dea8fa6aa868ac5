"""Holders found by scanning /proc/*/fd: against a fake proc tree and against the real /proc."""

from __future__ import annotations

import os
from pathlib import Path

from cubeaccel.host import procfs
from cubeaccel.host.pci import Holder
from tests.host.holder_proc import holding


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


def test_a_missing_proc_root_has_no_holders(tmp_path: Path) -> None:
    assert procfs.find_holders(procfs.glob("*"), tmp_path / "nope") == []


def test_real_process_holding_a_file_is_found_in_real_proc(tmp_path: Path) -> None:
    target = Path(os.path.realpath(tmp_path)) / "vfio-12"
    target.write_text("")
    assert procfs.find_holders(procfs.exact([str(target)])) == []
    with holding(target) as proc:
        found = procfs.find_holders(procfs.exact([str(target)]))
        assert [(h.pid, h.path) for h in found] == [(proc.pid, str(target))]
        assert found[0].command.startswith("python")
    assert procfs.find_holders(procfs.exact([str(target)])) == []
