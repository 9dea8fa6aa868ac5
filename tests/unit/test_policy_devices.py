"""The sandbox policy's QEMU devices and guest command line (shim/qemu.py `policy_argv`, shim/vmm.py)."""

from __future__ import annotations

from pathlib import Path

from cubeaccel.shim.qemu import policy_argv
from cubeaccel.shim.vmm import VmConfig
from cubeaccel.wire.shim_spec import parse_spec


def _cfg(
    tap_fd: int | None = None,
    mac: str | None = None,
    guest_net: str | None = None,
    scratch_fd: int | None = None,
    scratch_ro_fd: int | None = None,
    ro_mounts: tuple[tuple[str, str], ...] = (),
) -> VmConfig:
    return VmConfig(
        "sb-1",
        256,
        1,
        True,
        Path("/k"),
        Path("/i"),
        "console=ttyS0",
        Path("/state"),
        tap_fd=tap_fd,
        mac=mac,
        guest_net=guest_net,
        scratch_fd=scratch_fd,
        scratch_ro_fd=scratch_ro_fd,
        ro_mounts=ro_mounts,
    )


def test_a_closed_sandbox_gets_no_nic_no_disk_no_share() -> None:
    cfg = _cfg()
    assert policy_argv(cfg) == [] and cfg.guest_cmdline() == "" and cfg.inherited_fds == ()
    assert not cfg.policy_devices


def test_nic_and_scratch_disk_are_inherited_descriptors_and_the_guest_is_told_its_address() -> None:
    cfg = _cfg(
        tap_fd=7, mac="52:54:00:aa:bb:cc", guest_net="169.254.100.2/30,169.254.100.1", scratch_fd=8, scratch_ro_fd=9
    )
    argv = policy_argv(cfg)
    assert "tap,id=net0,fd=7,vhost=off" in argv
    assert "virtio-net-pci,netdev=net0,mac=52:54:00:aa:bb:cc,romfile=" in argv
    assert "fd=8,set=9,opaque=scratch.img" in argv and "fd=9,set=9,opaque=scratch.img" in argv
    assert any(a.startswith("file=/dev/fdset/9,") for a in argv)
    assert not any("path=" in a or "ifname=" in a for a in argv)  # no host file or TAP name is opened by QEMU
    assert cfg.inherited_fds == (7, 8, 9) and cfg.policy_devices
    assert cfg.guest_cmdline() == "cube.net=169.254.100.2/30,169.254.100.1 cube.scratch=vda"


def test_readonly_mounts_are_read_only_9p_shares() -> None:
    cfg = _cfg(ro_mounts=(("/srv/models", "/models"),))
    argv = policy_argv(cfg)
    assert "local,id=ro0,path=/srv/models,security_model=none,readonly=on" in argv
    assert cfg.guest_cmdline() == "cube.ro=cube-ro0:/models"


def test_the_spec_refuses_a_malformed_network_or_scratch_size() -> None:
    import pytest

    from cubeaccel.protocol.errors import CubeError

    base = {"sandbox_id": "sb-1", "memory_mib": 256, "state_dir": "/s", "report": {"file": "/r"}}
    ok = parse_spec(
        {
            **base,
            "scratch_mib": 64,
            "network": {
                "netns": "/run/netns/cube-sb-1",
                "tap": "tap0",
                "guest_cidr": "169.254.100.2/30",
                "gateway": "169.254.100.1",
                "mac": "52:54:00:aa:bb:cc",
            },
        }
    )
    assert ok.policy_devices
    for bad in (
        {"scratch_mib": 1},
        {
            "network": {
                "netns": "relative",
                "tap": "t",
                "guest_cidr": "1.2.3.4/30",
                "gateway": "1.2.3.1",
                "mac": "52:54:00:aa:bb:cc",
            }
        },
    ):
        with pytest.raises(CubeError) as e:
            parse_spec({**base, **bad})
        assert e.value.code == "shim.invalid_spec"
