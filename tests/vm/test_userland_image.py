"""The userland flavour in a real MicroVM: what E2B's `base` template offers a command, run as the E2B SDK runs it
(`/bin/bash -l -c CMD` as user `user`, through the guest's workload service and the shim's bridge).

On the validation image every one of these fails (no git, curl, sudo, tput, pip, procps' ps, gawk: exit 127);
docs/images.md has the flavours and how to build them.
"""

from __future__ import annotations

import json
import secrets
import shlex
import uuid
from collections.abc import Iterator

import httpx
import pytest

from cubeaccel.images.manifest import Manifest
from cubeaccel.images.userland import BASE_USERLAND
from tests.support.cpio_names import cpio_names
from tests.support.vmm_cleanup import kill_started_vmms
from tests.vm.conftest import ShimRun, emulated_id
from tests.workload_client import WorkloadClient

# The first test also builds (or takes) the validation and userland images, behind other builders' lock.
pytestmark = [pytest.mark.vm, pytest.mark.timeout(900)]
USERLAND_GUEST_MIB = 512  # the initrd (~120 MB) and the rootfs it unpacks to are both in RAM during boot

# What E2B base users (and the SDK's own test suite) run, each expected to exit 0.
COMMANDS = {
    "git": "git --version",
    "curl": "curl --version",
    "sudo": 'sudo -n true && test "$(sudo -n id -u)" = 0',
    "sudo_quiet": 'test -z "$(sudo -n true 2>&1)" && test "$(uname -n)" = sandbox',  # no "unable to resolve host"
    "tput": "tput cols",
    "pip": "python3 -m pip --version",
    "python": "python -c 'import sys; assert sys.version_info[0] == 3'",
    "ps": "ps --version | grep -q procps && ps -e -o args= | grep -q '[c]ubeaccel.workload serve'",
    "xargs": "printf 'a\\nb\\n' | xargs -n1 echo | wc -l | grep -qx 2",
    "grep": "echo needle | grep -E -q '^ne+dle$'",
    "gawk": "gawk 'BEGIN { print 6 * 7 }' | grep -qx 42 && awk --version | grep -q GNU",
    "sed": "echo abc | sed 's/b/x/' | grep -qx axc",
    "find": "find /usr/bin -name git | grep -q git",
    "git_commit": 'cd "$(mktemp -d)" && git init -q && git -c user.email=u@x -c user.name=u commit -q'
    " --allow-empty -m m && git log --oneline | wc -l | grep -qx 1",
    # E2B's own suite sets metadata this way: needs `attr` and a home with user xattrs (not 6.1's tmpfs)
    "setfattr": "cd && test ! -e lost+found && echo c > x.txt && setfattr -n user.e2b.author -v mish x.txt"
    " && getfattr --only-values -n user.e2b.author x.txt | grep -qx mish",
    "ca_bundle": "test -s /etc/ssl/certs/ca-certificates.crt && python3 -c 'import ssl; "
    'assert ssl.create_default_context().cert_store_stats()["x509_ca"] > 100\'',
    # what the SDK's users check first: each of E2B base's tools is found on PATH
    "command_v": "for t in xargs sort grep git curl sudo tput python3 pip ls awk sed find; do"
    ' command -v "$t" >/dev/null || { echo "missing $t"; exit 1; }; done',
    # E2B's own git tests serve their remote with `git daemon`: a clone from it over loopback
    "git_daemon": 'd="$(mktemp -d)" && git init -q --bare "$d/r.git" && git daemon --reuseaddr --export-all'
    ' --base-path="$d" --listen=127.0.0.1 --port=9418 --detach --pid-file="$d/pid"'
    " && for i in $(seq 100); do git ls-remote git://127.0.0.1/r.git >/dev/null 2>&1 && break; sleep 0.1; done"
    ' && git clone -q git://127.0.0.1/r.git "$d/c" 2>&1 | grep -v "empty repository"; test -d "$d/c/.git"; rc=$?;'
    ' kill "$(cat "$d/pid")"; exit $rc',
}


@pytest.fixture(scope="module")
def vm(tmp_path_factory: pytest.TempPathFactory, userland_image: Manifest) -> Iterator[ShimRun]:
    base = tmp_path_factory.mktemp("userland")
    sandbox = f"u-{uuid.uuid4().hex[:10]}"
    spec = {
        "sandbox_id": sandbox,
        "devices": [
            {
                "device_id": emulated_id(11),
                "driver": "edu",
                "properties": {},
                "vendor_id": "1234",
                "device_id_hex": "11e8",
            }
        ],
        "memory_mib": USERLAND_GUEST_MIB,
        "vcpus": 1,
        "pin_memory": True,
        "image_manifest": str(userland_image.directory / "manifest.json"),
        "start": "cold",
        "state_dir": str(base / "state"),
        "report": {"file": str(base / "reports.jsonl")},
        "detach_timeout_s": 10.0,
        "boot_timeout_s": 240.0,  # TCG on a loaded host: the larger initrd unpacks and boots in seconds to minutes
        "workload": True,
    }
    (base / "spec.json").write_text(json.dumps(spec))
    run = ShimRun(sandbox, base / "spec.json", base / "reports.jsonl", base / "state")
    run.workload_token = secrets.token_urlsafe(24)
    run.start()
    try:
        run.wait_for("guest_validated", 300)
        yield run
    finally:
        if run.proc is not None and run.proc.poll() is None:
            run.proc.kill()
            run.proc.wait()
        kill_started_vmms(base)


@pytest.fixture
def wl(vm: ShimRun) -> Iterator[WorkloadClient]:
    transport = httpx.HTTPTransport(uds=str(vm.state_dir / "workload.sock"))
    http = httpx.Client(transport=transport, base_url="http://workload", timeout=180.0)
    assert vm.workload_token is not None
    yield WorkloadClient(http, vm.workload_token)
    http.close()


@pytest.mark.parametrize("image", ["userland_image", "gpu_image"])
def test_every_image_a_template_pins_carries_the_whole_base_userland(
    request: pytest.FixtureRequest, image: str
) -> None:
    """The GPU image is the userland with NVIDIA's stack added: nothing of the userland is missing from it."""
    m: Manifest = request.getfixturevalue(image)
    names = cpio_names(m.path(m.rootfs))
    missing = {tool: rel for tool, rel in BASE_USERLAND.items() if rel not in names}
    assert not missing, f"{m.key}: {missing}"
    assert "usr/share/git-core/templates/description" in names  # git init's templates, not only the directory


def test_the_image_records_its_flavour(userland_image: Manifest) -> None:
    assert userland_image.flavour == "userland" and userland_image.key.startswith("userland-")
    names = {p["name"] for p in userland_image.packages}
    assert {"git", "curl", "sudo", "ncurses-bin", "python3-pip", "procps", "gawk", "findutils"} <= names


@pytest.mark.parametrize("tool", sorted(COMMANDS))
def test_e2b_base_tools_run_as_user_in_a_login_shell(wl: WorkloadClient, tool: str) -> None:
    s = wl.run(COMMANDS[tool])  # envd's default user: `user`
    out = (s.output() + s.output("stderr")).decode(errors="replace")
    assert s.end.get("exitCode", 0) == 0 and s.end.get("exited"), f"{tool}: {s.end} {out[-800:]}"


def test_the_commands_ran_as_user_and_sudo_made_root(wl: WorkloadClient) -> None:
    s = wl.run("id -un; sudo -n id -un; tput -T xterm cols")
    assert s.output().decode().split() == ["user", "root", "80"], s.output()


def _ok(wl: WorkloadClient, script: str) -> str:
    s = wl.run(script)
    out = (s.output() + s.output("stderr")).decode(errors="replace")
    assert s.end.get("exitCode", 0) == 0 and s.end.get("exited"), f"{script}: {s.end} {out[-800:]}"
    return s.output().decode()


def test_tmp_and_the_home_share_one_disk_bounded_below_the_guests_memory(wl: WorkloadClient) -> None:
    """Bounded together: one RAM disk holds both (each on its own, at half the memory, could fill the guest)."""
    tmp_dev, home_dev = _ok(wl, "stat -c %d /tmp; stat -c %d ~").split()
    assert tmp_dev == home_dev
    disk_kib, mem_kib = (int(x) for x in _ok(wl, "df -k --output=size /tmp | tail -1; grep MemTotal /proc/meminfo"
                                              " | tr -s ' ' | cut -d' ' -f2").split())  # fmt: skip
    assert disk_kib < mem_kib // 2, (disk_kib, mem_kib)
    assert _ok(wl, "stat -c %a /tmp").strip() == "1777"


def test_the_guests_services_are_out_of_the_oom_killers_reach_and_commands_are_not(wl: WorkloadClient) -> None:
    out = _ok(
        wl,
        "for p in $(ps -e -o pid=,args= | grep -E '[c]ubeaccel\\.(agent|workload) serve' | cut -c1-8); do"
        " cat /proc/$p/oom_score_adj; done; echo self $(cat /proc/self/oom_score_adj)",
    )
    *services, (_, mine) = [line.split() for line in out.splitlines()]
    assert len(services) >= 2 and all(s == ["-1000"] for s in services), out
    assert mine == "100"


def test_a_command_that_fills_tmp_and_its_home_gets_enospc_and_the_sandbox_keeps_answering(wl: WorkloadClient) -> None:
    """What used to OOM the guest (its services killed, the sandbox `running`, calls hanging): now a full disk."""
    fill = (
        "import errno, os, sys\n"
        "n = 0\n"
        "for path in ('/tmp/fill', os.path.expanduser('~/fill')):\n"
        "    try:\n"
        "        with open(path, 'wb') as f:\n"
        "            while n < 4096:\n"
        "                f.write(b'x' * (1 << 20)); f.flush(); n += 1\n"
        "    except OSError as e:\n"
        "        print(path, errno.errorcode[e.errno], n)\n"
    )
    try:
        out = _ok(wl, f"python3 -c {shlex.quote(fill)}").split()
        assert out[1] == "ENOSPC" and out[4] == "ENOSPC", out  # /tmp filled the disk, then the home found it full
        assert _ok(wl, "echo still here").strip() == "still here"
    finally:
        _ok(wl, "rm -f /tmp/fill ~/fill")
    assert _ok(wl, "head -c 1048576 /dev/zero > /tmp/again && echo ok; rm /tmp/again").strip() == "ok"


# Stops the workload service (as root, the tenant's sudo) and resumes it later from a process of its own session.
FREEZE = (
    "import os, signal, subprocess, sys, time\n"
    "pid = int(subprocess.run(['pgrep', '-f', '-o', 'cubeaccel.workload serve'], capture_output=True,"
    " text=True).stdout.split()[0])\n"
    "if os.fork() == 0:\n"
    "    os.setsid()\n"
    "    if os.fork() == 0:\n"
    "        time.sleep(float(sys.argv[1]))\n"
    "        os.kill(pid, signal.SIGCONT)\n"
    "    os._exit(0)\n"
    "os.kill(pid, signal.SIGSTOP)\n"
)


def test_a_workload_service_that_stops_answering_is_named_to_the_caller_and_reported(
    vm: ShimRun, wl: WorkloadClient
) -> None:
    """Nothing closes a virtio port when the guest's service stops: the bridge's PINGs go unanswered, calls get a
    503 naming `workload.unresponsive` instead of hanging, the shim reports it, and the service is served again
    once it answers. (Last in this module: the service is frozen for minutes.)"""
    assert "workload_unresponsive" not in vm.kinds()  # boot, validation, a full disk: none made it miss a PING
    resume_after_s = 240  # past the bridge's 20 s, stretched up to 3x on a loaded host
    with pytest.raises(httpx.HTTPError):  # this call's reply can never come: the service froze under it
        wl.run(f"sudo -n python3 -c {shlex.quote(FREEZE)} {resume_after_s}")
    reported = vm.wait_for("workload_unresponsive", 120)
    assert reported["details"]["reason"] == "workload.unresponsive"
    refused = wl.http.post("/process.Process/Start", json={}, headers={"X-Access-Token": wl.token})
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "workload.unresponsive"
    vm.wait_for("workload_recovered", resume_after_s + 120)
    assert _ok(wl, "echo back").strip() == "back"
