"""What a reservation asked for, typed: the frozen contract as it crossed processes, and the recorded parameters.

A frozen contract travels CubeMaster → Cubelet (reservation body) → the Cubelet's journal → the shim's spec →
cube-agent. Each hop holds it parsed (`CarriedContract`), and passes on the JSON it arrived as, unchanged: the
agent reads `guest_probes` as the sender derived them, and the journal and the spec file keep their bytes.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from cubeaccel.model.contract import CompatibilityContract
from cubeaccel.model.sandbox_policy import AddressNarrowing, NetworkPolicy, parse_narrowing
from cubeaccel.protocol.errors import CubeError, invalid

INVALID_CONTRACT = "reserve.invalid_contract"


@dataclass(frozen=True)
class CarriedContract(CompatibilityContract):
    """A contract read from another process's JSON: `to_json` gives back that JSON, not a re-derivation."""

    carried: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def to_json(self) -> dict[str, Any]:
        return copy.deepcopy(dict(self.carried))  # callers may edit what they get


def parse_contract(data: object) -> CarriedContract:
    """A frozen contract as a peer sent it. A tampered one keeps its own code (`contract.digest_mismatch`, …);
    any other malformed one is `reserve.invalid_contract`."""
    if isinstance(data, CarriedContract):
        return data
    if isinstance(data, CompatibilityContract):
        return CarriedContract(data.template, data.digest, data.to_json())
    try:
        if not isinstance(data, Mapping):
            raise TypeError(f"not an object: {type(data).__name__}")
        parsed = CompatibilityContract.from_json(data)
    except CubeError:
        raise
    except (KeyError, TypeError, ValueError) as e:
        raise invalid(INVALID_CONTRACT, f"invalid frozen contract: {e}", layer="template") from e
    return CarriedContract(parsed.template, parsed.digest, copy.deepcopy(dict(data)))


@dataclass(frozen=True)
class NetworkRequest:
    """A request's narrowing of its template's network policy, parsed (`parse_narrowing`); passed on as the JSON
    it came as. The node derives the effective policy from it again (`narrowed`)."""

    asked: NetworkPolicy | AddressNarrowing
    carried: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def parse(cls, data: object) -> NetworkRequest:
        if isinstance(data, NetworkRequest):
            return data
        asked = parse_narrowing(data)  # a non-object is `network.invalid_policy`
        assert isinstance(data, dict)
        return cls(asked, copy.deepcopy(data))

    def to_json(self) -> dict[str, Any]:
        return copy.deepcopy(dict(self.carried))


@dataclass(frozen=True)
class ReservationParams:
    """The reservation request as the Cubelet recorded it (`reservations.params`): the contract's memory and the
    effective network policy, re-derived on the node. Its JSON is the journal's column; `network` and `tenant`
    are left out when unset, as the rows written before this type have them."""

    count: int = 1
    accel_class: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    template: str | None = None
    memory_mib: int = 512
    vcpus: int = 1
    pin_memory: bool = True
    contract: CarriedContract | None = None
    lifetime_s: float | None = None  # from start; None: the Cubelet's default lifetime
    network: NetworkPolicy | None = None  # the effective policy, only when the sandbox has a NIC
    tenant: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "count": self.count,
            "class": self.accel_class,
            "labels": dict(self.labels),
            "template": self.template,
            "memory_mib": self.memory_mib,
            "vcpus": self.vcpus,
            "pin_memory": self.pin_memory,
            "contract": None if self.contract is None else self.contract.to_json(),
            "lifetime_s": self.lifetime_s,
            **({"network": self.network.to_json()} if self.network is not None else {}),
            **({"tenant": self.tenant} if self.tenant is not None else {}),
        }

    def as_stored(self) -> dict[str, Any]:
        """The JSON as the journal holds it, keys sorted at every level: what the Cubelet serves and puts in
        errors (it served the row it read back)."""
        loaded: dict[str, Any] = json.loads(json.dumps(self.to_json(), sort_keys=True))
        return loaded

    @classmethod
    def from_json(cls, data: object) -> ReservationParams:
        """A journal row's params (any row this node wrote); a field of the wrong type is refused by name."""
        if not isinstance(data, dict):
            raise ValueError(f"reservation params must be an object, got {type(data).__name__}")
        labels = data.get("labels") or {}
        if not isinstance(labels, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in labels.items()
        ):
            raise ValueError("reservation params: labels must map strings to strings")
        lifetime = data.get("lifetime_s")
        contract = data.get("contract")
        network = data.get("network")
        return cls(
            count=_int(data, "count", 1),
            accel_class=_opt_str(data, "class"),
            labels=dict(labels),
            template=_opt_str(data, "template"),
            memory_mib=_int(data, "memory_mib", 512),
            vcpus=_int(data, "vcpus", 1),
            pin_memory=_bool(data, "pin_memory", True),
            contract=None if contract is None else parse_contract(contract),
            lifetime_s=None if lifetime is None else _number(lifetime, "lifetime_s"),
            network=None if network is None else NetworkPolicy.from_json(network),
            tenant=_opt_str(data, "tenant"),
        )


def _int(data: Mapping[str, Any], key: str, default: int) -> int:
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"reservation params: {key} must be an integer, got {value!r:.40}")
    return value


def _bool(data: Mapping[str, Any], key: str, default: bool) -> bool:
    value = data.get(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"reservation params: {key} must be a boolean, got {value!r:.40}")
    return value


def _opt_str(data: Mapping[str, Any], key: str) -> str | None:
    value = data.get(key)
    if value is not None and not isinstance(value, str):
        raise ValueError(f"reservation params: {key} must be a string, got {value!r:.40}")
    return value


def _number(value: object, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"reservation params: {key} must be a number, got {value!r:.40}")
    return value
