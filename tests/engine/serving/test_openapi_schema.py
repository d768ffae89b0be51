"""/openapi.json tells the truth about what the API answers (each case here was found by
schemathesis, tests/engine/serving/test_fuzz_openapi.py)."""

from __future__ import annotations

import httpx


def schema(server) -> dict:
    return httpx.get(f"{server.url}/openapi.json").json()


def assert_openai_error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def test_metrics_is_documented_as_prometheus_text(server):
    doc = schema(server)["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(doc) == ["text/plain"]
    assert httpx.get(f"{server.url}/metrics").headers["content-type"].startswith("text/plain")


def test_errors_are_documented_and_no_422(server):
    paths = schema(server)["paths"]
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = paths[path]["post"]["responses"]
        assert {"200", "400", "404", "429", "503"} <= set(responses) and "422" not in responses
        assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}
        assert responses["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorBody")
    assert "422" not in paths["/v1/models/{model}"]["get"]["responses"]


def test_a_body_that_is_not_utf8_gets_an_openai_error(server):
    resp = httpx.post(f"{server.url}/v1/completions", content=b"\xff\xfeP\x10U",
                      headers={"content-type": "application/json"})
    assert resp.status_code == 400
    assert_openai_error(resp, 400)


def test_unknown_routes_and_methods_get_openai_errors(server):
    assert assert_openai_error(httpx.get(f"{server.url}/v1/nothing-here"), 404)["code"] == "not_found"
    # A model id with a newline matches no route ("{model:path}" stops at it).
    assert_openai_error(httpx.get(f"{server.url}/v1/models/a%0Ab"), 404)
    resp = httpx.delete(f"{server.url}/v1/completions")
    assert assert_openai_error(resp, 405)["code"] == "method_not_allowed"
    assert "POST" in resp.headers["allow"]


def test_the_disaggregation_routes_document_their_refusals(server):
    """Found by schemathesis once prefill/decode routes landed: a server of another role answers
    them 404, a body without its fields 400, both undocumented."""
    paths = schema(server)["paths"]
    assert {"404", "503"} <= set(paths["/disagg/info"]["get"]["responses"])
    assert {"400", "404", "409", "503"} <= set(paths["/disagg/prefill"]["post"]["responses"])
    assert {"400", "404", "503"} <= set(paths["/disagg/abort"]["post"]["responses"])
    resp = httpx.get(f"{server.url}/disagg/info")
    assert assert_openai_error(resp, 404)["code"] == "wrong_role"
