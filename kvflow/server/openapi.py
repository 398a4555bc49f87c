"""The OpenAPI description at /openapi.json (and its page at /docs). Routes read their bodies themselves
(serving.parse_body, for kvflow's error messages), so FastAPI cannot see them: each route names its body
model here, and the models' JSON schemas are added to the description's components. What each route
answers (its success body or stream, its errors in its API's shape) is filled in by openapi_responses.py."""

from __future__ import annotations

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from kvflow.server import openapi_responses

_MODELS: dict[str, type[BaseModel]] = {}
_REF = "#/components/schemas/{model}"


def body(model: type[BaseModel]) -> dict:
    """openapi_extra for a route whose JSON body is `model`."""
    _MODELS[model.__name__] = model
    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": {"$ref": _REF.format(model=model.__name__)}}}}}


def install(app) -> None:
    """Make app.openapi() include the body models' schemas."""
    from fastapi.openapi.utils import get_openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes,
                              description="OpenAI- and Ollama-compatible inference server")
            _, top = models_json_schema([(m, "validation") for m in _MODELS.values()], ref_template=_REF)
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            schemas.update(top.get("$defs", {}))
            for unused in ("HTTPValidationError", "ValidationError"):  # FastAPI's 422, which kvflow never sends
                schemas.pop(unused, None)
            openapi_responses.document(doc)
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi
