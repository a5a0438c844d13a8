"""The published OpenAPI description: a valid OpenAPI 3.1 document (checked by a real validator)
whose request schemas are the very models the front validates with."""
from __future__ import annotations

import jsonschema
import pytest
from openapi_spec_validator import validate
from pydantic import ValidationError

from pdserve.front.openai_schema import ChatCompletionRequest, CompletionRequest
from pdserve.front.openapi import openapi_document


@pytest.mark.parametrize("auth", [False, True])
def test_the_document_is_valid_openapi_3_1(auth):
    doc = openapi_document("SmolLM2-135M-Instruct", auth=auth)
    validate(doc)  # raises with the offending path on any error
    assert doc["openapi"].startswith("3.1")
    assert set(doc["paths"]) >= {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"}
    assert ("securitySchemes" in doc["components"]) == auth


def schema_of(doc: dict, name: str) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator({"$ref": f"#/components/schemas/{name}", "components": doc["components"]})


REQUESTS = [
    (CompletionRequest, {"model": "m", "prompt": "hi"}),
    (CompletionRequest, {"model": "m", "prompt": [1, 2, 3], "n": 2, "logprobs": 5, "min_p": 0.1, "top_k": -1}),
    (CompletionRequest, {"model": "m", "prompt": "hi", "some_client_field": {"x": 1}}),
    (CompletionRequest, {"model": "m", "prompt": "hi", "stream_options": {"include_usage": True,
                                                                          "continuous_usage_stats": True}}),
    (CompletionRequest, {"model": "m", "prompt": "hi", "temperature": "hot"}),
    (CompletionRequest, {"model": "m", "prompt": "hi", "n": 17}),
    (CompletionRequest, {"model": "m", "prompt": "hi", "logprobs": 21}),
    (CompletionRequest, {"model": "m", "prompt": "hi", "repetition_penalty": 0}),
    (CompletionRequest, {"model": "m"}),
    (CompletionRequest, {"model": "m", "prompt": "hi", "response_format": {"type": "yaml"}}),
    (ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "hi", "tool_calls": []}]}),
    (ChatCompletionRequest, {"model": "m", "messages": [{"role": "user",
                                                         "content": [{"type": "text", "text": "hi"}]}],
                             "logprobs": True, "top_logprobs": 3, "response_format": {"type": "json_object"}}),
    (ChatCompletionRequest, {"model": "m", "messages": [{"role": "wizard", "content": "hi"}]}),
    (ChatCompletionRequest, {"model": "m", "messages": []}),
    (ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": 5}]}),
]


@pytest.mark.parametrize("model,body", REQUESTS)
def test_published_request_schemas_agree_with_the_front(model, body):
    """What the schema accepts the front accepts, and what it refuses the front refuses (for rules a
    schema can state; cross-field rules such as min_tokens <= max_tokens are the front's alone)."""
    doc = openapi_document("m", auth=False)
    by_schema = schema_of(doc, model.__name__).is_valid(body)
    try:
        model.model_validate(body)
        by_front = True
    except ValidationError:
        by_front = False
    assert by_schema == by_front
