"""schemathesis against the server's own OpenAPI document (``GET /openapi.json``, completed by
:mod:`minfer.server.openapi` with the request bodies and the error answers every route can give).

Every generated request, valid or not, must get an answer the document lists, with the content type and
the schema it lists: never a 500, never an undocumented status. The example count is bounded so the
whole file runs in seconds on the tiny gemma3 fixture.
"""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from conftest import fixture_dir
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)
from server_process import ServerProcess

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          negative_data_rejection]


@pytest.fixture(scope="module")
def running_server():
    model = fixture_dir("gemma3") / "model-f32.gguf"
    with ServerProcess(model, ["--parallel", "2", "--ctx-size", "128", "--log-format", "off", "--slots"]) as s:
        yield s


@pytest.fixture(scope="module")
def api_schema(running_server):
    r = httpx.get(running_server.url + "/openapi.json", timeout=10)
    assert r.status_code == 200 and r.json()["paths"]["/v1/chat/completions"]["post"]["requestBody"]
    loaded = schemathesis.openapi.from_url(running_server.url + "/openapi.json")
    # the coverage phase makes every boundary case of every field, beyond max_examples: minutes, not seconds
    loaded.config.phases.coverage.enabled = False
    return loaded


schema = schemathesis.pytest.from_fixture("api_schema")


def test_every_route_documents_the_error_answers(running_server):
    doc = httpx.get(running_server.url + "/openapi.json", timeout=10).json()
    for path, operations in doc["paths"].items():
        for method, op in operations.items():
            assert {"400", "401", "413", "429"} <= set(op["responses"]), (method, path)
            assert "422" not in op["responses"], (method, path)


@schema.parametrize()
@settings(max_examples=15, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck), database=None)
def test_api_conforms_to_its_schema(case):
    body = case.body
    if isinstance(body, dict) and (body.get("max_tokens") is None or isinstance(body["max_tokens"], int)):
        # short generations keep the run bounded (a string or a negative number stays: a negative case)
        case.body["max_tokens"] = min(case.body.get("max_tokens") or 4, 4)
    case.call_and_validate(checks=CHECKS, timeout=60)
