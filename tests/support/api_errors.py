"""What the serving tests check of a refused request: OpenAI's error shape, and a server that
keeps serving afterwards."""

from __future__ import annotations

import httpx


def post(server, path: str, body) -> httpx.Response:
    content = body if isinstance(body, (str, bytes)) else None
    return httpx.post(f"{server.url}{path}", content=content, json=None if content is not None else body,
                      headers={"content-type": "application/json"}, timeout=30)


def assert_error(resp: httpx.Response, status: int, param: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    if param is not None:
        assert err["param"] == param
    return err


def assert_still_serving(server):
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/ready").status_code == 200
    ok = post(server, "/v1/completions", {"model": server.model, "prompt": "ok", "max_tokens": 2})
    assert ok.status_code == 200, ok.text
