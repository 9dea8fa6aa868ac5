"""Templates and each accelerator class's default one: `/v1/templates`, `/v1/template-defaults/{accel_class}`."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from cubeaccel.master.api.deps import MasterDep
from cubeaccel.transport.api_edges import json_body
from cubeaccel.wire import master_api as W

router = APIRouter()


@router.post(
    "/v1/templates",
    status_code=201,
    response_model=W.TemplateRegistered,
    openapi_extra=json_body("TemplateDocument"),
)
def register_template(master: MasterDep, document: dict[str, Any], default: bool = False) -> W.TemplateRegistered:
    return master.registry.register(document, default)


@router.get("/v1/templates", response_model=W.TemplateList)
def templates(master: MasterDep) -> W.TemplateList:
    return W.TemplateList(templates=master.registry.list(), defaults=master.store.defaults())


@router.get("/v1/templates/{ref}", response_model=W.TemplateShown)
def template(ref: str, master: MasterDep) -> W.TemplateShown:
    return master.registry.show(ref)


@router.delete("/v1/templates/{ref}", response_model=W.TemplateDeleted)
def delete_template(ref: str, master: MasterDep) -> W.TemplateDeleted:
    return master.registry.delete(ref)


@router.put("/v1/template-defaults/{accel_class}", response_model=W.DefaultSet)
def set_default(accel_class: str, body: W.DefaultBody, master: MasterDep) -> W.DefaultSet:
    master.registry.set_default(accel_class, body.template)
    return W.DefaultSet(accel_class=accel_class, template=body.template)
