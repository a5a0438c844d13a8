"""The front's OpenAPI 3.1 description (`GET /openapi.json`), generated from the pydantic models the
front validates requests with and the response shapes it answers with — one definition of each."""
from __future__ import annotations

from pydantic.json_schema import models_json_schema

from pdserve.front.openai_schema import ChatCompletionRequest, CompletionRequest
from pdserve.front.responses import (
    ChatCompletionChunk, ChatCompletionResponse, CompletionResponse, ErrorResponse, ModelList,
)

REF = "#/components/schemas/{model}"
IGNORED_FIELDS_HEADER = "X-Pdserve-Ignored-Fields"


def _ref(model) -> dict:
    return {"$ref": REF.format(model=model.__name__)}


def _errors(*codes: int) -> dict:
    why = {400: "invalid request (the message names the field)", 401: "missing or wrong API key",
           404: "no such model", 502: "a worker failed or died", 503: "no worker available", 504: "no progress"}
    return {str(c): {"description": why[c], "content": {"application/json": {"schema": _ref(ErrorResponse)}}}
            for c in codes}


def _sse_event(description: str) -> dict:
    # Before OpenAPI 3.2's `itemSchema`, an event stream's `schema` describes one event (as schemathesis and
    # OpenAPI 3.2 read it), not the stream as a whole: `data` is JSON text, or `[DONE]` at the end
    return {"type": "object", "description": description, "required": ["data"],
            "properties": {"data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"},
                           "retry": {"type": "integer", "minimum": 0}}}


def _generation(summary: str, request, response, chunk, op: str, auth: bool) -> dict:
    sse = (f"with `stream: true`: server-sent events, each `data:` a {chunk.__name__} (usage per chunk with "
           "`stream_options.continuous_usage_stats`), then `data: [DONE]`; an error after the stream "
           "started is one `data:` ErrorResponse, without `[DONE]`")
    post = {
        "operationId": op,
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(request)}}},
        "responses": {
            "200": {
                "description": "the completion",
                "headers": {IGNORED_FIELDS_HEADER: {
                    "description": "unknown request fields that were ignored (comma-separated names)",
                    "schema": {"type": "string"}}},
                "content": {"application/json": {"schema": _ref(response)},
                            "text/event-stream": {"schema": _sse_event(sse)}},
            },
            **_errors(400, 401, 404, 502, 503, 504),
        },
    }
    if auth:
        post["security"] = [{"bearer": []}]
    return {"post": post}


def openapi_document(model_name: str, *, auth: bool) -> dict:
    """The OpenAPI 3.1 document of a front serving `model_name` (`auth`: /v1 needs a bearer key)."""
    _, schemas = models_json_schema(
        [(CompletionRequest, "validation"), (ChatCompletionRequest, "validation"),
         (CompletionResponse, "serialization"), (ChatCompletionResponse, "serialization"),
         (ChatCompletionChunk, "serialization"), (ErrorResponse, "serialization"), (ModelList, "serialization")],
        ref_template=REF)
    models = {"get": {"operationId": "listModels", "summary": "the served model",
                      "responses": {"200": {"description": "models",
                                            "content": {"application/json": {"schema": _ref(ModelList)}}},
                                    **_errors(401)}}}
    if auth:
        models["get"]["security"] = [{"bearer": []}]
    status = {"type": "object", "additionalProperties": True}
    doc = {
        "openapi": "3.1.0",
        "info": {"title": "pdserve", "version": "1",
                 "description": f"OpenAI-compatible API of a pdserve deployment serving {model_name}. Unknown "
                                f"request fields are ignored and named in the {IGNORED_FIELDS_HEADER} header."},
        "paths": {
            "/v1/completions": _generation("Text completion", CompletionRequest, CompletionResponse,
                                           CompletionResponse, "createCompletion", auth),
            "/v1/chat/completions": _generation("Chat completion", ChatCompletionRequest, ChatCompletionResponse,
                                                ChatCompletionChunk, "createChatCompletion", auth),
            "/v1/models": models,
            "/health": {"get": {"operationId": "health", "summary": "liveness and the workers seen",
                                "responses": {"200": {"description": "up", "content": {"application/json": {"schema": status}}},
                                              "503": {"description": "no NATS connection",
                                                      "content": {"application/json": {"schema": status}}}}}},
            "/ready": {"get": {"operationId": "ready", "summary": "whether requests can be served now",
                               "responses": {"200": {"description": "ready", "content": {"application/json": {"schema": status}}},
                                             "503": {"description": "not ready",
                                                     "content": {"application/json": {"schema": status}}}}}},
            "/workers": {"get": {"operationId": "workers", "summary": "the workers this front routes to and their "
                                                                   "load (what `pdserve top` shows)",
                                 "responses": {"200": {"description": "workers", "content": {"application/json": {
                                     "schema": {"type": "object", "required": ["model", "workers"], "properties": {
                                         "model": {"type": "string"},
                                         "workers": {"type": "array", "items": {"type": "object"}}}}}}}}}},
            "/metrics": {"get": {"operationId": "metrics", "summary": "Prometheus metrics",
                                 "responses": {"200": {"description": "text exposition format",
                                                       "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
        },
        "components": {"schemas": schemas["$defs"]},
    }
    if auth:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return doc
