"""The frozen compatibility contract, and a request's network narrowing, as fields of a message: parsed on the way
in, their JSON unchanged on the way out (model/reservation_params.py)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import PlainSerializer, PlainValidator, WithJsonSchema
from pydantic_core import PydanticCustomError

from cubeaccel.model.contract import CompatibilityContract
from cubeaccel.model.errors import CubeError
from cubeaccel.model.reservation_params import CarriedContract, NetworkRequest, parse_contract
from cubeaccel.wire.base import cube_error_field


def _contract(value: Any) -> CarriedContract:
    if not isinstance(value, dict | CompatibilityContract):  # a shape error, as a plain dict field's
        raise PydanticCustomError("dict_type", "Input should be a valid dictionary")
    try:
        return parse_contract(value)
    except CubeError as e:
        raise cube_error_field(e) from e


# The schema stays a JSON object: the contract's own shape is model/contract.py's, documented in docs/templates.md.
Contract = Annotated[
    CarriedContract,
    PlainValidator(_contract),
    PlainSerializer(lambda c: c.to_json(), return_type=dict),
    WithJsonSchema({"additionalProperties": True, "type": "object"}),
]


def _network(value: Any) -> NetworkRequest:
    if not isinstance(value, dict | NetworkRequest):  # a shape error, as a plain dict field's
        raise PydanticCustomError("dict_type", "Input should be a valid dictionary")
    try:
        return NetworkRequest.parse(value)
    except CubeError as e:
        raise cube_error_field(e) from e


# A request's narrowing of the template's network policy (model/sandbox_policy.py), as it was sent.
Network = Annotated[
    NetworkRequest,
    PlainValidator(_network),
    PlainSerializer(lambda n: n.to_json(), return_type=dict),
    WithJsonSchema({"additionalProperties": True, "type": "object"}),
]
