"""The frozen compatibility contract as a field of a message: parsed on the way in, its JSON unchanged on the
way out (model/reservation_params.py `CarriedContract`)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator, PlainSerializer, WithJsonSchema
from pydantic_core import PydanticCustomError

from cubeaccel.model.contract import CompatibilityContract
from cubeaccel.model.errors import CubeError
from cubeaccel.model.reservation_params import CarriedContract, parse_contract
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
    BeforeValidator(_contract),
    PlainSerializer(lambda c: c.to_json(), return_type=dict),
    WithJsonSchema({"additionalProperties": True, "type": "object"}),
]
