"""The frozen compatibility contract, and a request's network narrowing, as fields of a message: parsed on the way
in, their JSON unchanged on the way out (model/reservation_params.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, TypeVar

from pydantic import PlainSerializer, PlainValidator, WithJsonSchema
from pydantic_core import PydanticCustomError

from cubeaccel.model.contract import CompatibilityContract
from cubeaccel.model.reservation_params import CarriedContract, NetworkRequest, parse_contract
from cubeaccel.protocol.errors import CubeError
from cubeaccel.wire.base import cube_error_field

T = TypeVar("T")


def _parsed(parse: Callable[[object], T], also: type) -> Callable[[Any], T]:
    """A pydantic validator of a JSON object field parsed by `parse` (or already parsed: `also`). Not an object
    is the shape error a plain dict field gives; the parser's own `CubeError` is kept for the edge."""

    def validate(value: Any) -> T:
        if not isinstance(value, dict | also):
            raise PydanticCustomError("dict_type", "Input should be a valid dictionary")
        try:
            return parse(value)
        except CubeError as e:
            raise cube_error_field(e) from e

    return validate


_contract = _parsed(parse_contract, CompatibilityContract)
_network = _parsed(NetworkRequest.parse, NetworkRequest)


# The schema stays a JSON object: the contract's own shape is model/contract.py's, documented in docs/templates.md.
Contract = Annotated[
    CarriedContract,
    PlainValidator(_contract),
    PlainSerializer(lambda c: c.to_json(), return_type=dict),
    WithJsonSchema({"additionalProperties": True, "type": "object"}),
]


# A request's narrowing of the template's network policy (model/sandbox_policy.py), as it was sent.
Network = Annotated[
    NetworkRequest,
    PlainValidator(_network),
    PlainSerializer(lambda n: n.to_json(), return_type=dict),
    WithJsonSchema({"additionalProperties": True, "type": "object"}),
]
