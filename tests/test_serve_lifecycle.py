"""`mtp serve` as an operator runs it: an API key, a full queue (429), and graceful shutdown on SIGTERM.

One server for the module, with `--api-key` and a queue of one waiting request. The SIGTERM test
shuts that server down, so it runs last (pytest keeps file order within a module).
"""

from __future__ import annotations

import json

import openai
import pytest
from conftest import random_heads, tiny_model
from test_serve_support import RawStream, Server, word_tokenizer

KEY = "sk-test-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "tiny-random"
COMPLETE = "/v1/completions"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = random_heads(tiny_model("llama", seed=5), seed=5)
    model.tokenizer = word_tokenizer()
    ckpt = tmp_path_factory.mktemp("lifecycle_ckpt")
    model.save_pretrained(ckpt)
    srv = Server(
        ckpt,
        "--api-key",
        KEY,
        "--served-model-name",
        MODEL,
        "--max-queue",
        "1",
        "--max-batch-size",  # one running request, so a second one waits and a third finds the queue full
        "1",
        "--max-context",
        "4096",
        "--shutdown-timeout",
        "60",
        "--speculation",
        "off",
    )
    yield srv
    srv.stop()


def _client(server: Server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=60)


def test_api_key_is_required_everywhere_but_health_and_the_page(server):
    with pytest.raises(openai.AuthenticationError):
        _client(server, "sk-wrong").completions.create(model=MODEL, prompt="w5 w6", max_tokens=3)
    resp = _client(server, KEY).completions.create(model=MODEL, prompt="w5 w6", max_tokens=3)
    assert resp.usage.completion_tokens == 3
    for method, path in [
        ("GET", "/v1/models"),
        ("GET", "/metrics"),
        ("POST", COMPLETE),
        ("POST", "/v1/chat/completions"),
    ]:
        status, headers, body = server.request(method, path, {"prompt": "w5"} if method == "POST" else None)
        assert status == 401, path
        assert json.loads(body)["error"]["code"] == "invalid_api_key" and headers["www-authenticate"] == "Bearer"
        status, _, _ = server.request(method, path, None, headers={"Authorization": "Bearer nope"})
        assert status == 401, path
    for path in ["/health", "/", "/static/app.js", "/static/style.css"]:
        status, _, _ = server.request("GET", path)
        assert status == 200, path
    assert json.loads(server.request("GET", "/health")[2])["auth_required"] is True
    status, _, body = server.request("GET", "/v1/models", headers=AUTH)
    assert status == 200 and json.loads(body)["data"][0]["id"] == MODEL
    assert server.metrics(AUTH)['mtp:request_errors_total{endpoint="/v1/models",status="401"}'] == 2


def test_speculation_default_is_a_server_option_and_requests_can_override_it(server):
    health = json.loads(server.request("GET", "/health")[2])
    assert health["speculative_default"] is False and "speculation off by default" in health["note"]
    body = {"model": MODEL, "prompt": "w5 w6", "max_tokens": 12}
    _, plain = server.post(COMPLETE, body, headers=AUTH)
    _, spec = server.post(COMPLETE, {**body, "speculative": True}, headers=AUTH)
    assert plain["mtp"]["speculative"] is False and plain["mtp"]["draft_tokens"] == 0
    assert spec["mtp"]["speculative"] is True and spec["mtp"]["draft_tokens"] > 0
    assert plain["choices"][0]["text"] == spec["choices"][0]["text"]


def test_a_full_queue_answers_429_and_recovers(server):
    long = {"model": MODEL, "prompt": "w9 w8 w7", "max_tokens": 3000, "stream": True}
    running = RawStream(server.port, COMPLETE, long, AUTH)
    assert running.status == 200
    next(running.events())  # the first token: it holds the model now
    waiting = RawStream(server.port, COMPLETE, long, AUTH)  # takes the one place in the queue
    assert waiting.status == 200
    server.wait_until(lambda: server.metrics(AUTH)["mtp:num_requests_waiting"] == 1, what="a waiting request")
    status, headers, body = server.request("POST", COMPLETE, {"model": MODEL, "prompt": "w5", "max_tokens": 2}, AUTH)
    assert status == 429 and headers["retry-after"] == "1"
    assert json.loads(body)["error"]["code"] == "queue_full"
    running.close()
    waiting.close()
    server.wait_until(
        lambda: (m := server.metrics(AUTH))["mtp:num_requests_running"] == 0 and m["mtp:num_requests_waiting"] == 0,
        what="both abandoned requests to be dropped",
    )
    status, _, body = server.request("POST", COMPLETE, {"model": MODEL, "prompt": "w5", "max_tokens": 2}, AUTH)
    assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 2


def test_sigterm_lets_the_running_stream_finish_then_exits_cleanly(server):
    stream = RawStream(
        server.port,
        COMPLETE,
        {
            "model": MODEL,
            "prompt": "w4 w5",
            "max_tokens": 400,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        AUTH,
    )
    events = stream.events()
    first = json.loads(next(events))
    assert first["choices"][0]["text"]
    server.terminate()
    rest = list(events)
    stream.close()
    assert rest[-1] == "[DONE]"
    assert json.loads(rest[-3])["choices"][0]["finish_reason"] == "length"
    assert json.loads(rest[-2])["usage"]["completion_tokens"] == 400  # all of them: not cut by the shutdown
    assert server.proc.wait(60) == 0
    assert "shutting down" in server.log and "Application shutdown complete" in server.log
