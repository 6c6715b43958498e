"""`mtp serve` end to end: a real server process, the real `openai` client, raw HTTP and headless Chromium.

One server for the whole module, serving a tiny Llama whose heads were fitted to be accurate (τ > 2 on
the fitted prompts), so accepted blocks of several tokens really happen and stop strings, EOS and
max_tokens can be placed inside them. Every expected text comes from the base model's own greedy
`generate()`, loaded independently in this process.
"""

from __future__ import annotations

import concurrent.futures
import copy
import json
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
import torch
from test_serve_support import RawStream, Server, sse_payloads, word_tokenizer, words

from mtp import MTPModel

MODEL = "tiny"
CONTEXT = 4096
# A fixed draft tree (16 nodes), for the server and for the in-process reference: the decoder's default
# may adapt its tree to timing, and these tests place stop strings and limits inside known blocks.
TREE = 16


@dataclass
class Served:
    server: Server
    ref: MTPModel  # the same checkpoint, loaded here: the source of expected outputs
    tokenizer: object
    prompts: list[list[int]]
    eos: int  # EOS id, chosen to fall inside an accepted block of prompts[0]'s answer
    client: openai.OpenAI

    def expected(self, ids: list[int], max_tokens: int) -> tuple[list[int], str, str]:
        """(new ids, text, finish_reason) of the base model's plain greedy generate()."""
        out = self.ref.base_model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False)
        new = out[0, len(ids) :].tolist()
        text = self.tokenizer.decode([t for t in new if t != self.eos], skip_special_tokens=True)
        return new, text, "stop" if new and new[-1] == self.eos else "length"

    def chat_ids(self, content: str) -> list[int]:
        enc = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, return_dict=True, return_tensors="pt"
        )
        return enc["input_ids"][0].tolist()

    def blocks(self, ids: list[int], max_tokens: int) -> tuple[list[int], list[tuple[int, int]]]:
        """New ids and (start, length) of each verify step's tokens, from the speculative decoder."""
        out = self.ref.generate(torch.tensor([ids]), max_new_tokens=max_tokens, return_dict_in_generate=True, tree=TREE)
        spans, pos = [], 1
        for a in out.accepted_lengths:
            spans.append((pos, a))
            pos += a
        return out.sequences[0, len(ids) :].tolist(), spans


def _choose_eos(ref: MTPModel, prompt: list[int]) -> int:
    """A token in the middle of an accepted block of `prompt`'s answer, seen there for the first time."""
    out = ref.generate(torch.tensor([prompt]), max_new_tokens=60, return_dict_in_generate=True, tree=TREE)
    new = out.sequences[0, len(prompt) :].tolist()
    pos = 1
    for a in out.accepted_lengths:
        for j in range(pos + 1, pos + a - 1):  # strictly inside the block
            if new[j] not in new[:j] and new[j] > 2:
                return new[j]
        pos += a
    raise AssertionError("no accepted block of 3+ tokens to put EOS into; heads not fitted?")


@pytest.fixture(scope="module")
def served(fitted, tmp_path_factory) -> Served:
    model, prompts, _ = fitted("llama")
    model = copy.deepcopy(model)  # the fitted model is shared by other test modules
    model.tokenizer = word_tokenizer()
    ckpt = tmp_path_factory.mktemp("serve_ckpt")
    model.save_pretrained(ckpt)
    prompt_ids = [p[0].tolist() for p in prompts]
    eos = _choose_eos(MTPModel.from_pretrained(ckpt), prompt_ids[0])
    gen_path = ckpt / "generation_config.json"
    gen = json.loads(gen_path.read_text())
    gen["eos_token_id"] = eos
    gen_path.write_text(json.dumps(gen))
    ref = MTPModel.from_pretrained(ckpt)
    assert ref.base_model.generation_config.eos_token_id == eos
    server = Server(
        ckpt, "--served-model-name", MODEL, "--max-context", str(CONTEXT), "--max-queue", "16", "--tree", str(TREE)
    )
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    yield Served(server, ref, model.tokenizer, prompt_ids, eos, client)
    server.stop()


def _stream_text(stream) -> tuple[str, list, object]:
    """Concatenated content, the chunks, and the usage chunk (if any) of an openai stream."""
    text, chunks, usage = "", [], None
    for chunk in stream:
        chunks.append(chunk)
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            piece = choice.delta.content if hasattr(choice, "delta") else choice.text
            text += piece or ""
    return text, chunks, usage


def _finish(chunks) -> str | None:
    reasons = [c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason]
    assert len(reasons) <= 1, reasons
    return reasons[0] if reasons else None


# ---- discovery --------------------------------------------------------------------------------------


def test_models_health_and_page_are_served(served):
    assert [m.id for m in served.client.models.list().data] == [MODEL]
    status, _, body = served.server.request("GET", "/health")
    assert status == 200 and json.loads(body)["status"] == "ok"
    status, headers, body = served.server.request("GET", "/")
    assert status == 200 and headers["content-type"].startswith("text/html") and b"/static/app.js" in body
    status, _, _ = served.server.request("GET", "/static/app.js")
    assert status == 200


# ---- exactness ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_completions_equal_greedy_generate(served, stream):
    taus = []
    for ids in served.prompts:
        new, text, finish = served.expected(ids, 40)
        if stream:
            got, chunks, usage = _stream_text(
                served.client.completions.create(
                    model=MODEL,
                    prompt=words(ids),
                    max_tokens=40,
                    temperature=0,
                    stream=True,
                    stream_options={"include_usage": True},
                )
            )
            assert _finish(chunks) == finish
            taus.append(chunks[-2].model_extra["mtp"]["tau"])  # the finish chunk carries the request's τ
        else:
            resp = served.client.completions.create(model=MODEL, prompt=words(ids), max_tokens=40, temperature=0)
            got, usage = resp.choices[0].text, resp.usage
            assert resp.choices[0].finish_reason == finish
            taus.append(resp.model_extra["mtp"]["tau"])
        assert got == text
        assert (usage.prompt_tokens, usage.completion_tokens) == (len(ids), len(new))
        assert usage.total_tokens == len(ids) + len(new)
    assert min(taus) > 1.5, taus  # speculation really accepted blocks on these prompts


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_chat_equals_greedy_generate_on_the_chat_template(served, stream):
    content = "w10 w20 w30 w40"
    ids = served.chat_ids(content)
    new, text, finish = served.expected(ids, 30)
    messages = [{"role": "user", "content": content}]
    if stream:
        got, chunks, usage = _stream_text(
            served.client.chat.completions.create(
                model=MODEL,
                messages=messages,
                max_tokens=30,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        assert chunks[0].choices[0].delta.role == "assistant"
        assert _finish(chunks) == finish
    else:
        resp = served.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0)
        got, usage = resp.choices[0].message.content, resp.usage
        assert resp.choices[0].finish_reason == finish and resp.choices[0].message.role == "assistant"
    assert got == text
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(ids), len(new))


def test_speculation_off_gives_the_same_text_one_token_per_step(served):
    ids = served.prompts[2]
    _, text, _ = served.expected(ids, 40)
    on = served.client.completions.create(model=MODEL, prompt=words(ids), max_tokens=40, temperature=0)
    off = served.client.completions.create(
        model=MODEL, prompt=words(ids), max_tokens=40, temperature=0, extra_body={"speculative": False}
    )
    assert on.choices[0].text == off.choices[0].text == text
    assert off.model_extra["mtp"] == {
        "tau": 1.0,
        "speculative": False,
        "verify_steps": 39,
        "draft_tokens": 0,
        "accepted_draft_tokens": 0,
    }
    assert on.model_extra["mtp"]["verify_steps"] < 39 and on.model_extra["mtp"]["speculative"] is True


def test_stream_sends_one_token_per_chunk_even_when_blocks_are_accepted(served):
    ids = served.prompts[3]
    new, text, _ = served.expected(ids, 40)
    status, _, raw = served.server.request(
        "POST", "/v1/completions", {"model": MODEL, "prompt": words(ids), "max_tokens": 40, "stream": True}
    )
    assert status == 200
    payloads = sse_payloads(raw)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    pieces = [c["choices"][0]["text"] for c in chunks if c["choices"] and c["choices"][0]["text"]]
    assert "".join(pieces) == text
    assert len(pieces) == len(new)  # every token its own chunk: no bursts glued together
    progress = [c["mtp"] for c in chunks if "mtp" in c and "steps" in c["mtp"]]
    assert any(b["steps"] == a["steps"] for a, b in zip(progress, progress[1:], strict=False))  # blocks happened
    assert progress[-1]["tokens"] == len(new)


# ---- stopping inside an accepted block ------------------------------------------------------------------


def _block_inside(served, min_len: int = 3):
    """(prompt ids, new ids, block start, block length) of a block of `min_len`+ tokens, no special ids."""
    for ids in served.prompts[1:]:
        new, spans = served.blocks(ids, 60)
        for start, length in spans[1:]:
            if length >= min_len and start + 2 < len(new) and all(t > 2 for t in new[: start + 2]):
                stop = f" w{new[start]} w{new[start + 1]}"
                full = served.tokenizer.decode(new, skip_special_tokens=True)
                if full.find(stop) == len(served.tokenizer.decode(new[:start])):
                    return ids, new, start, length
    raise AssertionError("no accepted block of 3+ tokens found; heads not fitted?")


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_stop_string_inside_an_accepted_block_ends_at_the_right_token(served, stream):
    ids, new, start, _ = _block_inside(served)
    stop = f" w{new[start]} w{new[start + 1]}"  # completed by the 2nd token of the block, not its last
    expected = served.tokenizer.decode(new[:start])
    kwargs = dict(model=MODEL, prompt=words(ids), max_tokens=60, temperature=0, stop=[stop, "never-matches"])
    if stream:
        got, chunks, usage = _stream_text(
            served.client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
        )
        assert _finish(chunks) == "stop"
        assert not any(stop.strip() in (c.choices[0].text or "") for c in chunks if c.choices)
    else:
        resp = served.client.completions.create(**kwargs)
        got, usage = resp.choices[0].text, resp.usage
        assert resp.choices[0].finish_reason == "stop"
    assert got == expected
    assert usage.completion_tokens == start + 2  # up to the token that completed the stop string, no more


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_max_tokens_inside_an_accepted_block(served, stream):
    ids, new, start, _ = _block_inside(served)
    limit = start + 2  # the block would have emitted more; the answer must end after its 2nd token
    expected = served.tokenizer.decode(new[:limit])
    kwargs = dict(model=MODEL, prompt=words(ids), max_tokens=limit, temperature=0)
    if stream:
        got, chunks, usage = _stream_text(
            served.client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
        )
        assert _finish(chunks) == "length"
    else:
        resp = served.client.completions.create(**kwargs)
        got, usage = resp.choices[0].text, resp.usage
        assert resp.choices[0].finish_reason == "length"
    assert got == expected and usage.completion_tokens == limit


def test_eos_inside_an_accepted_block_is_finish_reason_stop_and_not_shown(served):
    ids = served.prompts[0]
    new, text, finish = served.expected(ids, 60)
    assert finish == "stop" and new[-1] == served.eos and len(new) < 60
    for stream in (False, True):
        if stream:
            got, chunks, usage = _stream_text(
                served.client.completions.create(
                    model=MODEL,
                    prompt=words(ids),
                    max_tokens=60,
                    temperature=0,
                    stream=True,
                    stream_options={"include_usage": True},
                )
            )
            reason = _finish(chunks)
        else:
            resp = served.client.completions.create(model=MODEL, prompt=words(ids), max_tokens=60, temperature=0)
            got, usage, reason = resp.choices[0].text, resp.usage, resp.choices[0].finish_reason
        assert (got, reason, usage.completion_tokens) == (text, "stop", len(new))
        assert not got.endswith(f"w{served.eos}")


# ---- sampling ---------------------------------------------------------------------------------------------


def test_sampled_requests_call_generate_with_the_request_s_sampling_parameters(served):
    import inspect

    if "temperature" not in inspect.signature(served.ref.generate).parameters:
        pytest.skip("this build's generate() has no sampling")
    ids = served.prompts[1]
    # Speculation off: one fixed path, so the same seed must give exactly in-process generate()'s sample.
    kwargs = dict(model=MODEL, prompt=words(ids), max_tokens=30, temperature=0.9, top_p=0.95, seed=1234)
    a = served.client.completions.create(**kwargs, extra_body={"speculative": False})
    b = served.client.completions.create(**kwargs, extra_body={"speculative": False})
    gen = torch.Generator().manual_seed(1234)
    out = served.ref.generate(
        torch.tensor([ids]),
        max_new_tokens=30,
        do_sample=True,
        temperature=0.9,
        top_p=0.95,
        top_k=0,
        generator=gen,
        speculative=False,
    )
    expected = served.tokenizer.decode(out[0, len(ids) :].tolist(), skip_special_tokens=True)
    assert a.choices[0].text == b.choices[0].text == expected
    # Speculative sampling with top_k: a valid sampled answer (its draft tree may adapt to timing, so
    # no bit-for-bit comparison here; its exactness in distribution is the decoder's own test).
    c = served.client.completions.create(**kwargs, extra_body={"top_k": 20})
    assert c.usage.completion_tokens == 30 and c.choices[0].finish_reason == "length"
    assert c.model_extra["mtp"]["speculative"] is True


# ---- concurrency ------------------------------------------------------------------------------------------


def test_eight_concurrent_clients_all_get_their_own_correct_answer(served):
    jobs = []
    for i in range(8):
        if i % 2 == 0:
            ids = served.prompts[(i // 2) % len(served.prompts)]
            jobs.append(("completion", words(ids), served.expected(ids, 30)[1], i % 4 == 0))
        else:
            content = f"w{20 + i} w{40 + i}"
            jobs.append(("chat", content, served.expected(served.chat_ids(content), 30)[1], i % 4 == 1))

    def call(job):
        kind, prompt, _, stream = job
        if kind == "completion":
            kwargs = dict(model=MODEL, prompt=prompt, max_tokens=30, temperature=0)
            if stream:
                return _stream_text(served.client.completions.create(**kwargs, stream=True))[0]
            return served.client.completions.create(**kwargs).choices[0].text
        kwargs = dict(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=30, temperature=0)
        if stream:
            return _stream_text(served.client.chat.completions.create(**kwargs, stream=True))[0]
        return served.client.chat.completions.create(**kwargs).choices[0].message.content

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(call, jobs))
    assert results == [j[2] for j in jobs]
    m = served.server.metrics()  # they were decoded together: some forwards carried several rows
    assert m["mtp:batch_size_count"] > 0 and m['mtp:batch_size_bucket{le="1"}'] < m["mtp:batch_size_count"]
    assert m["mtp:tokens_per_forward_count"] == m["mtp:batch_size_count"]


# ---- bad input --------------------------------------------------------------------------------------------

CHAT, COMPLETE = "/v1/chat/completions", "/v1/completions"
MSG = [{"role": "user", "content": "w5"}]
BAD_REQUESTS = [
    ("malformed JSON", "POST", CHAT, b'{"model": "tiny", "messages": [', 400, None),
    ("body not an object", "POST", COMPLETE, b"[1, 2, 3]", 400, None),
    ("unknown model", "POST", CHAT, {"model": "gpt-9", "messages": MSG}, 404, "model_not_found"),
    (
        "prompt longer than the context",
        "POST",
        COMPLETE,
        {"prompt": "w7 " * (CONTEXT + 5)},
        400,
        "context_length_exceeded",
    ),
    (
        "prompt + max_tokens beyond the context",
        "POST",
        COMPLETE,
        {"prompt": "w7 w8", "max_tokens": CONTEXT - 1},
        400,
        "context_length_exceeded",
    ),
    ("negative max_tokens", "POST", COMPLETE, {"prompt": "w5", "max_tokens": -3}, 400, None),
    ("zero max_tokens", "POST", CHAT, {"messages": MSG, "max_tokens": 0}, 400, None),
    ("huge max_tokens", "POST", CHAT, {"messages": MSG, "max_tokens": 10**12}, 400, "context_length_exceeded"),
    ("max_tokens as a string", "POST", COMPLETE, {"prompt": "w5", "max_tokens": "10"}, 400, None),
    ("temperature as a string", "POST", CHAT, {"messages": MSG, "temperature": "hot"}, 400, None),
    ("temperature out of range", "POST", CHAT, {"messages": MSG, "temperature": 7}, 400, None),
    ("messages not a list", "POST", CHAT, {"messages": "hello"}, 400, None),
    ("empty messages", "POST", CHAT, {"messages": []}, 400, None),
    ("unknown role", "POST", CHAT, {"messages": [{"role": "wizard", "content": "w5"}]}, 400, None),
    ("stream not a boolean", "POST", CHAT, {"messages": MSG, "stream": "yes"}, 400, None),
    ("n = 2", "POST", CHAT, {"messages": MSG, "n": 2}, 400, None),
    ("stop not a string", "POST", COMPLETE, {"prompt": "w5", "stop": 5}, 400, None),
    ("token id outside the vocabulary", "POST", COMPLETE, {"prompt": [5, 10**6]}, 400, None),
    ("missing prompt", "POST", COMPLETE, {"model": MODEL}, 400, None),
    ("unsupported logprobs", "POST", COMPLETE, {"prompt": "w5", "logprobs": 3}, 400, "unsupported_parameter"),
    ("wrong method", "GET", CHAT, None, 405, None),
    ("unknown route", "POST", "/v1/engines", {"prompt": "w5"}, 404, None),
]


@pytest.mark.parametrize(
    "method,path,body,status,code", [b[1:] for b in BAD_REQUESTS], ids=[b[0] for b in BAD_REQUESTS]
)
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(served, method, path, body, status, code):
    got, _, raw = served.server.request(method, path, body)
    assert got == status, raw
    err = json.loads(raw)["error"]
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
    assert set(err) == {"message", "type", "param", "code"}
    if code is not None:
        assert err["code"] == code
    ok, body = served.server.post(COMPLETE, {"model": MODEL, "prompt": "w5 w6", "max_tokens": 2})
    assert ok == 200 and body["usage"]["completion_tokens"] == 2


def test_an_oversized_body_is_refused_before_it_is_read(served):
    sock = socket.create_connection(("127.0.0.1", served.server.port), timeout=30)
    head = f"POST {COMPLETE} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {2**30}\r\n\r\n"
    sock.sendall(head.encode() + b'{"prompt": "')  # a 1 GiB body announced, a few bytes sent
    reply = sock.makefile("rb")
    status = reply.readline().decode()
    headers = dict(line.decode().strip().lower().split(": ", 1) for line in iter(reply.readline, b"\r\n"))
    body = json.loads(reply.read(int(headers["content-length"])))
    sock.close()
    assert status.startswith("HTTP/1.1 413") and body["error"]["type"] == "invalid_request_error"


def test_openai_client_raises_the_matching_exceptions(served):
    with pytest.raises(openai.NotFoundError):
        served.client.completions.create(model="gpt-9", prompt="w5", max_tokens=2)
    with pytest.raises(openai.BadRequestError) as info:
        served.client.completions.create(model=MODEL, prompt="w5", max_tokens=CONTEXT * 10)
    assert info.value.code == "context_length_exceeded"


# ---- disconnects ------------------------------------------------------------------------------------------


def _aborts(served) -> float:
    return served.server.metrics().get('mtp:request_success_total{finished_reason="abort"}', 0.0)


def test_client_disconnect_mid_stream_stops_generation_and_frees_the_slot(served):
    before = served.server.metrics()
    stream = RawStream(
        served.server.port, COMPLETE, {"model": MODEL, "prompt": "w9 w8 w7", "max_tokens": 3000, "stream": True}
    )
    assert stream.status == 200
    events = stream.events()
    for _ in range(3):
        assert json.loads(next(events))["choices"][0]["text"]
    stream.close()
    aborts = before.get('mtp:request_success_total{finished_reason="abort"}', 0.0)
    served.server.wait_until(lambda: _aborts(served) == aborts + 1, what="the aborted request to finish")
    after = served.server.metrics()
    assert after["mtp:num_requests_running"] == 0
    made = after["mtp:generation_tokens_total"] - before["mtp:generation_tokens_total"]
    assert 3 <= made < 3000  # generation stopped early
    ok, body = served.server.post(COMPLETE, {"model": MODEL, "prompt": "w5 w6", "max_tokens": 3})
    assert ok == 200 and body["usage"]["completion_tokens"] == 3


def test_disconnect_and_bad_input_under_load_leave_the_other_rows_exact(served):
    """Four answers decode together while a fifth stream hangs up mid-answer and bad requests arrive: the
    four are still exactly their greedy answers, the abandoned row is freed, nothing keeps running."""
    aborts = _aborts(served)
    quitter = RawStream(
        served.server.port, COMPLETE, {"model": MODEL, "prompt": "w9 w8 w7", "max_tokens": 3000, "stream": True}
    )
    assert quitter.status == 200
    events = quitter.events()
    next(events)
    jobs = [(words(ids), served.expected(ids, 30)[1]) for ids in served.prompts]

    def call(prompt: str) -> str:
        resp = served.client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0)
        return resp.choices[0].text

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(call, p) for p, _ in jobs]
        next(events)
        quitter.close()  # hangs up while the others run
        for body in (b'{"model": "tiny", "prompt": [', {"prompt": "w7 " * (CONTEXT + 5)}):
            assert served.server.request("POST", COMPLETE, body)[0] == 400
        results = [f.result() for f in futures]
    assert results == [text for _, text in jobs]
    served.server.wait_until(lambda: _aborts(served) == aborts + 1, what="the abandoned row to be freed")
    served.server.wait_until(lambda: served.server.metrics()["mtp:num_requests_running"] == 0, what="an idle server")


def test_client_disconnect_while_waiting_for_a_json_answer_stops_generation(served):
    aborts = _aborts(served)
    data = json.dumps({"model": MODEL, "prompt": "w9 w8 w6", "max_tokens": 3000}).encode()
    head = (
        f"POST {COMPLETE} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    sock = socket.create_connection(("127.0.0.1", served.server.port))
    sock.sendall(head.encode() + data)
    served.server.wait_until(lambda: served.server.metrics()["mtp:num_requests_running"] == 1, what="it to start")
    sock.close()  # hang up without reading the answer
    served.server.wait_until(lambda: _aborts(served) == aborts + 1, what="the abandoned request to stop")
    assert served.server.metrics()["mtp:num_requests_running"] == 0


# ---- metrics ----------------------------------------------------------------------------------------------


def test_metrics_count_requests_tokens_latency_and_speculation(served):
    served.client.completions.create(model=MODEL, prompt=words(served.prompts[1]), max_tokens=40, temperature=0)
    m = served.server.metrics()
    assert m['mtp:requests_total{endpoint="/v1/completions"}'] >= 1
    assert m['mtp:request_errors_total{endpoint="/v1/completions",status="400"}'] >= 1  # from the bad-input tests
    assert m["mtp:generation_tokens_total"] >= 40 and m["mtp:prompt_tokens_total"] >= 1
    assert m["mtp:time_to_first_token_seconds_count"] >= 1 and m["mtp:inter_token_latency_seconds_count"] >= 39
    assert m['mtp:time_to_first_token_seconds_bucket{le="+Inf"}'] == m["mtp:time_to_first_token_seconds_count"]
    drafts, drafted = m["mtp:spec_decode_num_drafts_total"], m["mtp:spec_decode_num_draft_tokens_total"]
    accepted = m["mtp:spec_decode_num_accepted_tokens_total"]
    # positions past the heads' depth are lookup-chain drafts (prompt lookup grafted onto the tree)
    npos = sum(1 for k in m if k.startswith("mtp:spec_decode_num_accepted_tokens_per_pos_total{"))
    assert npos >= 4
    per_pos = [m[f'mtp:spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}}'] for i in range(npos)]
    assert 0 < accepted <= drafted and drafts > 0
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)
    assert 1 + accepted / drafts > 1.3  # mean acceptance length, as vLLM derives it


# ---- load script ------------------------------------------------------------------------------------------


def test_load_script_reports_figures_with_and_without_speculation(served, tmp_path):
    out = tmp_path / "load.json"
    res = subprocess.run(
        [
            sys.executable,
            "bench/load.py",
            "--url",
            served.server.url,
            "--model-name",
            MODEL,
            "--requests",
            "4",
            "--concurrency",
            "2",
            "--max-tokens",
            "12",
            "--time-limit",
            "60",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).parents[1],
    )
    assert res.returncode == 0, res.stderr
    report = json.loads(out.read_text())
    (level,) = report["levels"]
    assert level["concurrency"] == 2 and set(level["modes"]) == {"mtp-speculative", "mtp-plain"}
    for mode in level["modes"].values():
        assert mode["completed"] == 4 and mode["errors"] == 0
        assert mode["requests_per_s"] > 0 and 0 < mode["ttft_p50_s"] <= mode["latency_p50_s"]
        assert mode["latency_p50_s"] <= mode["latency_p95_s"]
    assert level["modes"]["mtp-plain"]["tau_mean"] == 1.0
    assert "requests/s" in res.stdout


# ---- the chat page ----------------------------------------------------------------------------------------

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")


@pytest.mark.skipif(
    not CHROMIUM.exists(),
    reason="needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)",
)
def test_chat_page_streams_an_answer_in_headless_chromium(served, tmp_path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    content = "w11 w22 w33"
    _, expected, _ = served.expected(served.chat_ids(content), 24)
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        "--window-size=1280,860",
        f"--user-data-dir={tmp_path / 'profile'}",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    try:
        driver.get(served.server.url + "/")
        wait = WebDriverWait(driver, 60)
        wait.until(lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-ready") == "true")
        assert driver.find_element(By.ID, "model-name").text == MODEL
        max_tokens = driver.find_element(By.ID, "max-tokens")
        max_tokens.clear()
        max_tokens.send_keys("24")
        driver.find_element(By.ID, "prompt").send_keys(content)
        driver.find_element(By.ID, "send").click()
        done = ".msg.assistant[data-state=done]"
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, done)) == 1)
        answer = driver.find_elements(By.CSS_SELECTOR, done)[0]
        assert answer.find_element(By.CSS_SELECTOR, ".text").get_attribute("textContent") == expected
        assert int(answer.get_attribute("data-chunks")) > 1  # it arrived in pieces, not in one block
        meta = answer.find_element(By.CSS_SELECTOR, ".meta").text
        assert "tok/s" in meta and "τ" in meta and "speculation on" in meta
        # The switch: the same question with speculation off gives the same answer, τ = 1.
        driver.find_element(By.ID, "speculative").click()
        driver.find_element(By.ID, "again").click()
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, done)) == 2)
        second = driver.find_elements(By.CSS_SELECTOR, done)[1]
        assert second.find_element(By.CSS_SELECTOR, ".text").get_attribute("textContent") == expected
        rows = driver.find_elements(By.CSS_SELECTOR, "#runs tbody tr")
        cells = [[td.text for td in r.find_elements(By.TAG_NAME, "td")] for r in rows]
        assert [c[1] for c in cells] == ["on", "off"] and cells[1][5] == "1.00"
        driver.save_screenshot(str(tmp_path / "chat_page.png"))
    finally:
        driver.quit()
