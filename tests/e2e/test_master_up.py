"""`cubeaccel up --detach`: CubeMaster + one Cubelet on free ports, example templates as class defaults."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cubeaccel.master.up import _cubelet_takes_pinnable, choose_backend, run_down, run_up
from cubeaccel.model.errors import CubeError
from cubeaccel.wire.master_client import MasterClient


def test_backend_choice_says_which_and_why() -> None:
    backend, why = choose_backend("auto")
    assert backend in ("simulated", "emulated") and why
    assert choose_backend("simulated") == ("simulated", "asked for with --backend")
    with pytest.raises(CubeError) as e:
        choose_backend("magic")
    assert e.value.code == "up.unknown_backend"


def test_up_detached_registers_a_node_and_the_defaults_then_down_stops_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_up(tmp_path, "simulated", "h100x2", detach=True) == 0
    try:
        out = capsys.readouterr().out
        assert "backend: simulated — asked for with --backend" in out
        info = json.loads((tmp_path / "up.json").read_text())
        c = MasterClient(info["master_url"])
        [node] = c.nodes()
        assert node["state"] == "ready" and node["total"] == 2
        defaults = c.request("GET", "/v1/templates")["defaults"]
        assert defaults == {"gpu": "cuda12-h100", "accelerator": "edu-demo"}
        if _cubelet_takes_pinnable():
            assert c.create({"gpu": "H100:1"})["state"] == "running"
        else:  # the example pins 64 GiB; this host's Cubelet advertises what it can really lock
            try:
                assert c.create({"gpu": "H100:1"})["state"] == "running"
            except CubeError as e:
                assert e.details["tried"][0]["nodes"]["local"]["reason"] == "pinned_memory"
        c.close()
    finally:
        assert run_down(tmp_path) == 0
    assert not (tmp_path / "up.json").exists()
