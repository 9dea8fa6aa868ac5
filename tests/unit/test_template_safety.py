"""No snapshot holds a device, and pruning never deletes a state a restore is reading — without a VMM.

The QMP replies are shaped like QEMU 7.2's for the template machine (`query-pci` of a q35 -nodefaults VM with
virtio-serial and root ports; `qom-list` of the user-created devices); the real-QEMU twin is in
tests/vm/test_template_guard.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from cubeaccel.backends.emulated import pci_testdev_identity
from cubeaccel.host.vmm.hypervisor import detect_accel
from cubeaccel.protocol.errors import CubeError
from cubeaccel.shim import snapshot_guard as guard
from cubeaccel.shim.qemu import QemuVmm
from cubeaccel.shim.template import prune_templates, template_key, template_lease
from cubeaccel.shim.vmm import VmConfig


def _fn(slot: int, vendor: int, device: int, qdev: str = "", func: int = 0, bridge: Any = None) -> dict[str, Any]:
    d: dict[str, Any] = {
        "bus": 0,
        "slot": slot,
        "function": func,
        "qdev_id": qdev,
        "class_info": {"class": 0},
        "id": {"vendor": vendor, "device": device},
        "regions": [],
    }
    if bridge is not None:
        d["pci_bridge"] = {"bus": {"number": slot, "secondary": slot, "subordinate": slot}, "devices": bridge}
    return d


def template_pci(behind_rp1: list[dict[str, Any]] | None = None, extra: list[dict[str, Any]] | None = None) -> Any:
    return [
        {
            "bus": 0,
            "devices": [
                _fn(0, 0x8086, 0x29C0),
                _fn(1, 0x1AF4, 0x1003, "vser0"),
                _fn(2, 0x1B36, 0x000C, "rp1", bridge=behind_rp1 or []),
                _fn(3, 0x1B36, 0x000C, "rp2", bridge=[]),
                *(extra or []),
                _fn(31, 0x8086, 0x2918),
                _fn(31, 0x8086, 0x2922, func=2),
                _fn(31, 0x8086, 0x2930, func=3),
            ],
        }
    ]


TEMPLATE_QOM = {
    "/machine/peripheral": [
        {"name": "type", "type": "string"},
        {"name": "rp1", "type": "child<pcie-root-port>"},
        {"name": "rp2", "type": "child<pcie-root-port>"},
        {"name": "vser0", "type": "child<virtio-serial-pci>"},
    ],
    "/machine/peripheral-anon": [
        {"name": "type", "type": "string"},
        {"name": "device[0]", "type": "child<virtserialport>"},
    ],
}
EDU = 0x1234, 0x11E8


def test_the_template_machine_itself_has_no_foreign_device() -> None:
    assert guard.foreign_pci(template_pci()) == []
    assert [f for p, q in TEMPLATE_QOM.items() for f in guard.foreign_qom(p, q)] == []


def test_a_device_behind_a_root_port_is_foreign_whatever_its_id() -> None:
    found = guard.foreign_pci(template_pci(behind_rp1=[_fn(0, 0x1AF4, 0x1003, "sneaky")]))
    assert [(f["behind"], f["vendor_device"], f["qdev_id"]) for f in found] == [("rp1", "1af4:1003", "sneaky")]


def test_an_unknown_function_on_the_root_bus_is_foreign() -> None:
    found = guard.foreign_pci(template_pci(extra=[_fn(4, *EDU, "accel0")]))
    assert [(f["vendor_device"], f["behind"], f["slot"]) for f in found] == [("1234:11e8", None, 4)]


def test_a_hot_plug_the_guest_has_not_enumerated_is_seen_in_qom() -> None:
    qom = [*TEMPLATE_QOM["/machine/peripheral"], {"name": "hp0", "type": "child<edu>"}]
    assert guard.foreign_qom("/machine/peripheral", qom) == [
        {
            "source": "qom",
            "why": "device type not in the template machine",
            "path": "/machine/peripheral",
            "qdev_id": "hp0",
            "type": "edu",
        }
    ]


class FakeQmp:
    """Answers like QEMU; `during_migrate` is what query-pci says once the migration ran (a late device_add)."""

    def __init__(self, pci: Any, during_migrate: Any = None) -> None:
        self.pci, self.after = pci, during_migrate
        self.sent: list[str] = []
        self.migrated_to: int | None = None
        self.passed: int | None = None  # the descriptor QEMU would get by SCM_RIGHTS (the VMM opens no files)

    def send_fd_scm(self, fd: int) -> None:
        self.passed = os.dup(fd)

    def cmd(self, command: str, **args: Any) -> Any:
        self.sent.append(command)
        if command == "query-pci":
            return self.after if self.migrated_to is not None and self.after is not None else self.pci
        if command == "qom-list":
            return TEMPLATE_QOM[args["path"]]
        if command == "migrate":
            assert args["uri"] == "fd:migration" and self.passed is not None
            self.migrated_to = self.passed
            os.write(self.passed, b"state")
            os.close(self.passed)
            return {}
        if command == "query-migrate":
            return {"status": "completed"}
        return {}


def _vmm(tmp_path: Path, qmp: FakeQmp) -> QemuVmm:
    cfg = VmConfig(
        sandbox_id="template-x",
        memory_mib=256,
        vcpus=1,
        pin_memory=False,
        kernel=tmp_path / "k",
        initrd=tmp_path / "i",
        cmdline="",
        state_dir=tmp_path,
    )
    vmm = QemuVmm(cfg)
    vmm._qmp = qmp  # type: ignore[assignment]
    return vmm


def test_save_state_refuses_a_hot_plugged_device_before_any_migrate(tmp_path: Path) -> None:
    qmp = FakeQmp(template_pci(behind_rp1=[_fn(0, *EDU, "hp0")]))
    with pytest.raises(CubeError) as e:
        _vmm(tmp_path, qmp).save_state(tmp_path / "state")
    assert e.value.code == "lifecycle.snapshot_with_device" and e.value.status == 409
    assert [d["vendor_device"] for d in e.value.details["devices"]] == ["1234:11e8"]
    assert "migrate" not in qmp.sent and not (tmp_path / "state").exists()


def test_a_device_added_during_the_migration_discards_the_written_state(tmp_path: Path) -> None:
    qmp = FakeQmp(template_pci(), during_migrate=template_pci(behind_rp1=[_fn(0, *EDU, "hp0")]))
    with pytest.raises(CubeError) as e:
        _vmm(tmp_path, qmp).save_state(tmp_path / "state")
    assert e.value.code == "lifecycle.snapshot_with_device" and "migrate" in qmp.sent
    assert not (tmp_path / "state").exists() and not (tmp_path / "state.partial").exists()


def test_a_clean_template_machine_is_saved(tmp_path: Path) -> None:
    qmp = FakeQmp(template_pci())
    _vmm(tmp_path, qmp).save_state(tmp_path / "state")
    assert (tmp_path / "state").read_bytes() == b"state"
    assert qmp.sent.index("query-pci") < qmp.sent.index("migrate")


# -- pruning vs restore ---------------------------------------------------------------------------------------
def _templates(root: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[VmConfig, Any]:
    """A templates root with an existing state for `cfg` (the newest) and three older ones."""
    monkeypatch.setenv("CUBEACCEL_QEMU", sys.executable)  # template_key stats the binary; nothing runs it
    cfg = VmConfig(
        sandbox_id="sb",
        memory_mib=256,
        vcpus=1,
        pin_memory=True,
        kernel=root / "k",
        initrd=root / "i",
        cmdline="",
        state_dir=root / "sd",
    )
    manifest = SimpleNamespace(image_digest="sha256:" + "0" * 64)
    for i, name in enumerate(["old-1", "old-2", "old-3", template_key(cfg, manifest, detect_accel()[0])]):  # type: ignore[arg-type]
        (root / name).mkdir(parents=True)
        (root / name / "state").write_bytes(b"s")
        os.utime(root / name, (1000 + i, 1000 + i))
    return cfg, manifest


def test_prune_refuses_while_a_restore_holds_the_lease_and_runs_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg, manifest = _templates(tmp_path, monkeypatch)
    with template_lease(cfg, manifest, tmp_path) as state:
        assert state is not None and state.exists()
        assert prune_templates(tmp_path, keep=1) is None  # refused, nothing deleted
        assert all((tmp_path / n / "state").exists() for n in ("old-1", "old-2", "old-3"))
    assert sorted(prune_templates(tmp_path, keep=1) or []) == ["old-1", "old-2", "old-3"]
    assert state.exists()


def test_a_start_that_finds_no_snapshot_for_its_shape_gets_none_and_nothing_is_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg, manifest = _templates(tmp_path, monkeypatch)
    before = sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("."))
    with template_lease(replace(cfg, memory_mib=cfg.memory_mib * 2), manifest, tmp_path) as state:
        assert state is None
    assert (
        sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == before
    )  # no build directory, no new key


def test_prune_waits_for_a_restore_in_another_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _templates(tmp_path, monkeypatch)
    holder = subprocess.Popen(  # a shim's restore: holds the lease until told to go on
        [
            sys.executable,
            "-c",
            "import sys, fcntl; f = open(sys.argv[1], 'a'); fcntl.flock(f, fcntl.LOCK_SH); "
            "print('held', flush=True); sys.stdin.readline()",
            str(tmp_path / ".prune.lock"),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        assert prune_templates(tmp_path, keep=1) is None
        result: list[list[str] | None] = []
        waiting = threading.Thread(target=lambda: result.append(prune_templates(tmp_path, keep=1, wait_s=60)))
        waiting.start()
        assert not result and (tmp_path / "old-1").exists()
        assert holder.stdin is not None
        holder.stdin.write("go\n")
        holder.stdin.flush()
        waiting.join(60)
        assert sorted(result[0] or []) == ["old-1", "old-2", "old-3"]
    finally:
        holder.kill()
        holder.wait()


def test_a_start_names_the_plan_it_restored_or_how_the_nearest_prepared_machine_differs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 64 GiB BAR's machine misses the edu-shaped state: the lookup says the shape differs, by how much."""
    from cubeaccel.model.bars import uniform_shape
    from cubeaccel.shim.template import machine_doc, snapshot_lookup

    cfg, manifest = _templates(tmp_path, monkeypatch)
    key = template_key(cfg, manifest, detect_accel()[0])
    meta = {"machine": machine_doc(cfg, manifest, detect_accel()[0]), "prepared_for": ["shape 256 MiB x 1"]}
    (tmp_path / key / "meta.json").write_text(json.dumps(meta))
    restored = snapshot_lookup(cfg, manifest, tmp_path, tmp_path / key / "state")
    assert (restored.key, restored.prepared_for, restored.prepared) == (key, ("shape 256 MiB x 1",), 4)
    testdev = pci_testdev_identity(64 << 30).bars
    wide = replace(cfg, shape=uniform_shape([testdev], cfg.root_ports, cfg.memory_mib))
    miss = snapshot_lookup(wide, manifest, tmp_path, None)
    assert miss.key != key and (miss.nearest, miss.differs) == (key, ("shape",))
    assert "shape 256 MiB x 1" in miss.why and "root port window 128 GiB here, 2 GiB there" in miss.why
    empty = snapshot_lookup(cfg, manifest, tmp_path / "none", None)
    assert (empty.prepared, empty.nearest, empty.why) == (0, None, "no template snapshot is prepared here")
