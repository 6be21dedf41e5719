"""The OpenAPI document as the gateway behaves (FastAPI's, corrected where the gateway answers otherwise)."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from gateway.policy.policies import Policy
from gateway.protocol.common import ErrorResponse
from gateway.settings import GatewaySettings


def contract(app: FastAPI, settings: GatewaySettings) -> dict:
    """The OpenAPI document as the gateway behaves: invalid requests are 400s in the OpenAI error shape (FastAPI would
    document 422s), the policy body a PUT reads itself is declared, limits set at run time are in it (max_tokens),
    and optional headers are strings (a header cannot be null)."""
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    bad_request = {"description": "Bad Request",
                   "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
    for operations in schema["paths"].values():
        for operation in operations.values():
            responses = operation.get("responses", {})
            if responses.pop("422", None) is not None:
                responses.setdefault("400", bad_request)
            for param in operation.get("parameters", []):
                branches = param.get("schema", {}).get("anyOf")
                if param.get("in") == "header" and branches:
                    kept = [b for b in branches if b.get("type") != "null"]
                    if len(kept) == 1:
                        param["schema"] = {**kept[0], "title": param["schema"].get("title", param["name"])}
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for model in ("ChatCompletionRequest", "CompletionRequest"):
        for name in ("max_tokens", "max_completion_tokens"):
            field = components.get(model, {}).get("properties", {}).get(name)
            if field is not None:
                for branch in field.get("anyOf", [field]):
                    if branch.get("type") == "integer":
                        branch["le"] = settings.max_tokens_limit
    components.setdefault("ErrorResponse", ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}"))
    policy = Policy.model_json_schema(ref_template="#/components/schemas/{model}")
    components.update(policy.pop("$defs", {}))
    components["Policy"] = policy
    for unused in ("HTTPValidationError", "ValidationError"):
        components.pop(unused, None)
    app.openapi_schema = _standard_bounds(schema)
    return app.openapi_schema


_BOUNDS = {"ge": "minimum", "le": "maximum", "gt": "exclusiveMinimum", "lt": "exclusiveMaximum"}


def _standard_bounds(node):
    """Integer fields that also take integral floats (12.0) carry pydantic's bound names in their schema; JSON Schema
    spells them minimum / maximum."""
    if isinstance(node, dict):
        if node.get("type") == "integer":
            node = {_BOUNDS.get(k, k): v for k, v in node.items()}
        return {k: _standard_bounds(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_standard_bounds(v) for v in node]
    return node
