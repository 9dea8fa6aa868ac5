"""Devices: the node's inventory as the journal holds it (`router`), and the audited operator verbs that move a
device by hand (`verbs`: quarantine, recover, disable, enable; the rules are in cubelet/operator.py)."""

from __future__ import annotations

from fastapi import APIRouter

from cubeaccel.cubelet import operator
from cubeaccel.cubelet.api.deps import CubeletDep
from cubeaccel.cubelet.lifecycle import Cubelet
from cubeaccel.protocol.errors import not_found
from cubeaccel.wire import cubelet_api as W

router = APIRouter()
verbs = APIRouter()

VERBS = {
    "quarantine": operator.quarantine,
    "recover": operator.recover,
    "disable": operator.disable,
    "enable": operator.enable,
}


def _device(cubelet: Cubelet, device_id: str) -> W.DeviceReply:
    d = cubelet.store.device(device_id)
    if d is None:
        raise not_found("device.not_found", f"no device {device_id!r}")
    return W.DeviceReply.of(d)


@router.get("/v1/devices", response_model=W.DeviceList)
def devices(cubelet: CubeletDep) -> W.DeviceList:
    return W.DeviceList(devices=[W.Device.of(d) for d in cubelet.store.devices()])


@router.get("/v1/devices/{device_id}", response_model=W.DeviceReply)
def device(device_id: str, cubelet: CubeletDep) -> W.DeviceReply:
    return _device(cubelet, device_id)


@verbs.post("/v1/devices/{device_id}/{verb}", response_model=W.DeviceReply)
def device_verb(device_id: str, verb: str, body: W.OperatorBody, cubelet: CubeletDep) -> W.DeviceReply:
    fn = VERBS.get(verb)
    if fn is None:
        raise not_found("api.unknown_verb", f"unknown device verb {verb!r}; known: {sorted(VERBS)}")
    _device(cubelet, device_id)
    if verb == "disable":
        return W.DeviceReply.of(operator.disable(cubelet, device_id, body.who, body.reason, body.restore_driver))
    return W.DeviceReply.of(fn(cubelet, device_id, body.who, body.reason))
