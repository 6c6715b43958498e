"""The batched engine (mtp.batching): every request decodes exactly what it would decode alone.

Greedy rows are compared token for token with the base model's own `generate()` of that prompt alone,
whatever else shares the batch: rows of different prompt lengths, requests joining and leaving mid-run, EOS
and max_new_tokens inside accepted runs, cancelled rows, plain rows beside speculative ones, sliding windows.
Sampled rows are checked against generate()'s exact distribution with the chi-square test of test_sampling.
"""

from __future__ import annotations

import conftest
import pytest
import torch
from conftest import ARCHS, VOCAB, fit_heads, tiny_model
from test_sampling import NEW, PROMPT, TREE, chi2_pvalue, exact_joint, peaked_model  # noqa: F401

from mtp.batch_cache import BatchCache
from mtp.batching import PROBE_SHARE, BatchDecoder, StepCost, generate_batch

# A cost curve where a 16-node forward costs about one token's (a CPU with bf16 units): speculation pays.
CHEAP_TREES = StepCost(tokens=(1, 16, 64, 256), seconds=(1.0, 1.05, 1.6, 4.0), draft_seconds=0.05)
# Free nodes: every row always drafts its full tree, whatever the batch size.
FLAT = StepCost(tokens=(1, 100000), seconds=(1.0, 1.0), draft_seconds=0.0)
# Compute-bound from the first extra token: every drafted node costs its full share, speculation never pays.
LINEAR = StepCost(tokens=(1, 256), seconds=(1.0, 256.0), draft_seconds=0.5)


def fitted_model(arch: str, **overrides):
    """Heads fitted on the model's own greedy continuations of 4 prompts (most drafts accepted): the same
    models as conftest's `fitted` fixture (shared through its cache), plus variants with config overrides."""
    key = arch if not overrides else arch + repr(sorted(overrides.items()))
    if key not in conftest._FITTED:
        base = tiny_model(arch, seed=1, **overrides)
        g = torch.Generator().manual_seed(123)
        prompts = [torch.randint(3, VOCAB, (1, n), generator=g) for n in (1, 4, 7, 12)]
        model, seqs = fit_heads(base, prompts)
        conftest._FITTED[key] = (model, prompts, seqs)
    model, prompts, _ = conftest._FITTED[key]
    return model, [p[0].tolist() for p in prompts]


def solo(model, prompt: list[int], max_new: int, **kw) -> list[int]:
    ids = torch.tensor([prompt])
    return model.base_model.generate(ids, max_new_tokens=max_new, do_sample=False, **kw)[0, len(prompt) :].tolist()


def run(engine: BatchDecoder, prompts, max_new, join_at=None, cancel_at=None, **kw):
    """Like generate_batch, plus cancellations and the finish updates."""
    join_at = join_at or [0] * len(prompts)
    maxes = max_new if isinstance(max_new, list) else [max_new] * len(prompts)
    ids, out, finish, step = {}, {}, {}, 0
    while len(ids) < len(prompts) or engine.has_work:
        for i, p in enumerate(prompts):
            if join_at[i] == step:
                ids[engine.add(p, maxes[i], **(kw.get("per_row", [{}] * len(prompts))[i]))] = i
        if cancel_at:
            for i, s in cancel_at.items():
                if s == step:
                    engine.cancel(next(r for r, j in ids.items() if j == i))
        for u in engine.step():
            out.setdefault(ids[u.request_id], []).extend(u.tokens)
            if u.finished:
                finish[ids[u.request_id]] = u
        step += 1
        assert step < 5000
    return [out.get(i, []) for i in range(len(prompts))], finish


@pytest.mark.parametrize("arch", ARCHS)
def test_rows_of_different_lengths_joining_mid_run_match_generate(arch):
    model, train = fitted_model(arch)
    g = torch.Generator().manual_seed(5)
    held_out = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (2, 9, 15)]
    prompts = train + held_out
    max_new = [40, 25, 48, 33, 20, 41, 30]
    engine = BatchDecoder(model, guard=False, max_batch_size=4, cost=CHEAP_TREES)
    outs, finish = run(engine, prompts, max_new, join_at=[0, 0, 2, 5, 5, 11, 30])
    for p, m, o in zip(prompts, max_new, outs, strict=True):
        assert o == solo(model, p, m), (arch, p)
    trained = [finish[i] for i in range(len(train))]
    taus = [sum(f.accepted_lengths) / len(f.accepted_lengths) for f in trained]
    assert min(taus) > 1.8, taus  # the fitted heads' drafts are mostly accepted inside the batch
    assert all(f.finish_reason == "length" for f in finish.values())


@pytest.mark.parametrize(
    "arch,overrides",
    [
        ("mistral", dict(sliding_window=8)),
        ("qwen2", dict(use_sliding_window=True, sliding_window=6, max_window_layers=1)),
    ],
    ids=["sliding", "mixed-sliding-full"],
)
def test_sliding_windows_match_generate(arch, overrides):
    model, train = fitted_model(arch, **overrides)
    engine = BatchDecoder(model, guard=False, cost=CHEAP_TREES)
    outs, _ = run(engine, train, 40, join_at=[0, 1, 1, 4])
    for p, o in zip(train, outs, strict=True):
        assert o == solo(model, p, 40)


def test_eos_and_max_new_tokens_inside_accepted_runs():
    model, train = fitted_model("llama")
    ref = [solo(model, p, 40) for p in train]
    engine = BatchDecoder(model, guard=False, cost=CHEAP_TREES)
    outs, finish = run(engine, train, 40)
    # Each row stops at its own EOS, chosen as a token in the middle of its reference continuation
    eos = [r[len(r) // 2] for r in ref]
    per_row = [dict(eos_token_id=e) for e in eos]
    engine = BatchDecoder(model, guard=False, cost=CHEAP_TREES)
    outs, finish = run(engine, train, 40, per_row=per_row)
    for p, r, e, o in zip(train, ref, eos, outs, strict=True):
        assert o == solo(model, p, 40, eos_token_id=e)
        assert o[-1] == e and len(o) == r.index(e) + 1
    assert all(f.finish_reason == "stop" for f in finish.values())
    # and max_new_tokens cutting inside a multi-token step
    lengths = finish[0].accepted_lengths
    assert max(lengths) >= 3
    cut = 1 + lengths[0] + 1  # prefill token + first step + one token into the second
    outs, finish = run(BatchDecoder(model, guard=False, cost=CHEAP_TREES), train, cut)
    for p, o in zip(train, outs, strict=True):
        assert o == solo(model, p, cut)
    assert all(f.finish_reason == "length" for f in finish.values())


def test_cancelled_row_frees_its_place_and_others_are_unaffected():
    model, train = fitted_model("qwen2")
    engine = BatchDecoder(model, guard=False, max_batch_size=3, cost=CHEAP_TREES)
    outs, finish = run(engine, train, 40, cancel_at={1: 3})
    assert finish[1].finish_reason == "abort" and 0 < len(outs[1]) < 40
    assert outs[1] == solo(model, train[1], 40)[: len(outs[1])]
    for i in (0, 2, 3):
        assert outs[i] == solo(model, train[i], 40)
    assert not engine.rows and engine.cache.num_rows == 0


def test_plain_rows_beside_speculative_ones():
    model, train = fitted_model("gpt2")
    engine = BatchDecoder(model, guard=False, cost=CHEAP_TREES)
    per_row = [dict(speculative=i % 2 == 0) for i in range(len(train))]
    outs, finish = run(engine, train, 36, per_row=per_row)
    for i, (p, o) in enumerate(zip(train, outs, strict=True)):
        assert o == solo(model, p, 36)
        if i % 2:
            assert set(finish[i].accepted_lengths) == {1} and set(finish[i].draft_tokens) == {0}
        else:
            assert max(finish[i].accepted_lengths) > 1


def test_load_aware_plan_becomes_plain_batched_decoding_when_compute_bound():
    """With a cost where every node costs a full token, speculation never pays: every step verifies one node
    per row (plain batched decoding); with cheap trees the same batch speculates."""
    model, train = fitted_model("llama")
    for cost, speculates in ((LINEAR, False), (CHEAP_TREES, True)):
        engine = BatchDecoder(model, guard=False, cost=cost, prompt_lookup=False, probe_every=10**9)
        outs, finish = run(engine, train, 30)
        assert [o == solo(model, p, 30) for p, o in zip(train, outs, strict=True)] == [True] * 4
        drafted = sum(sum(f.draft_tokens) for f in finish.values())
        assert (drafted > 0) == speculates, (cost, drafted)


def test_plan_prefers_speculation_for_one_row_and_plain_for_a_full_batch():
    """The same cost curve, measured shape: cheap up to 16 tokens, then linear. One row with accurate heads
    drafts the full tree; 64 rows (a compute-bound forward) do not."""
    model, train = fitted_model("llama")
    cost = StepCost(tokens=(1, 16, 64, 1024), seconds=(1.0, 1.1, 3.5, 56.0), draft_seconds=0.15)
    one = BatchDecoder(model, guard=False, cost=cost)
    one.add(train[1], 20)
    one.step()
    assert one._plan() > 1
    many = BatchDecoder(model, guard=False, cost=cost, max_batch_size=64)
    for _ in range(64):
        many.add(train[1], 20)
    many.step()
    assert len(many.rows) == 64 and many._plan() == 1


def test_rows_draft_shallower_trees_where_each_drafted_depth_costs():
    """A sequential drafter pays one drafter step per depth (`StepCost.depth_seconds`): where a depth costs as
    much as the whole verify forward, every speculating row's tree stays one depth deep; where depths are free,
    the same accurate heads draft deep trees. Either way each request decodes exactly what it decodes alone."""
    model, train = fitted_model("llama")
    dear = StepCost(tokens=(1, 100000), seconds=(1.0, 1.0), draft_seconds=0.05, depth_seconds=1.0)
    free = StepCost(tokens=(1, 100000), seconds=(1.0, 1.0), draft_seconds=0.05, depth_seconds=0.0)
    assert dear.draft(1) == 0.05 and dear.draft(3) == pytest.approx(2.05)
    for cost, shallow in ((dear, True), (free, False)):
        engine = BatchDecoder(model, guard=False, cost=cost, prompt_lookup=False, probe_every=10**9)
        depths = []
        score = engine._score

        def spy(trees, drafts, depths=depths, score=score):
            depths.extend(t.depth for t in trees if len(t) > 1)
            return score(trees, drafts)

        engine._score = spy
        outs, _ = run(engine, train, 30)
        assert outs == [solo(model, p, 30) for p in train]
        assert depths, "the rows drafted nothing"
        assert (max(depths) == 1) if shallow else (max(depths) >= 3), (cost, sorted(set(depths)))


def test_kv_budget_makes_requests_wait_and_rejects_what_never_fits():
    model, train = fitted_model("llama")
    probe = BatchDecoder(model, guard=False, cost=CHEAP_TREES)
    probe.add(train[-1], 40)
    footprint = probe._footprint(probe.waiting[0])  # prompt + max_new + tree + margin, in positions
    budget = 3 * footprint + 1  # three rows of the longest prompt fit, four do not
    engine = BatchDecoder(model, guard=False, max_kv_tokens=budget, cost=CHEAP_TREES)
    with pytest.raises(ValueError, match="KV budget"):
        engine.add(list(range(3, 3 + budget)), 40)
    outs, _ = run(engine, train, 40)
    assert [o == solo(model, p, 40) for p, o in zip(train, outs, strict=True)] == [True] * 4
    engine = BatchDecoder(model, guard=False, max_kv_tokens=budget, cost=CHEAP_TREES)
    for p in reversed(train):
        engine.add(p, 40)
    engine.step()
    assert engine.num_running == 3 and engine.num_waiting == 1


def test_long_prompt_prefilled_in_chunks_while_others_decode():
    model, train = fitted_model("llama")
    g = torch.Generator().manual_seed(9)
    long = torch.randint(3, VOCAB, (60,), generator=g).tolist()
    engine = BatchDecoder(model, guard=False, prefill_chunk=16, cost=CHEAP_TREES)
    outs, _ = run(engine, [train[0], long], 30, join_at=[0, 2])
    assert outs[0] == solo(model, train[0], 30)
    assert outs[1] == solo(model, long, 30)


def test_bad_input_is_a_clear_error():
    model, _ = fitted_model("gpt2")
    engine = BatchDecoder(model, guard=False, cost=CHEAP_TREES)
    with pytest.raises(ValueError, match="empty"):
        engine.add([], 4)
    with pytest.raises(ValueError, match="token ids"):
        engine.add([VOCAB + 5], 4)
    with pytest.raises(ValueError, match="positions"):
        engine.add([3] * 200, 100)  # GPT-2's 256 learned positions
    assert not engine.has_work


def test_batch_cache_commit_moves_each_rows_accepted_path():
    from transformers import DynamicCache

    cache = BatchCache()
    for n, base in ((3, 0.0), (5, 100.0)):
        solo_cache = DynamicCache()
        kv = (torch.arange(n, dtype=torch.float32) + base).view(1, 1, n, 1)
        solo_cache.update(kv, kv.clone(), 0)
        cache.add_row(solo_cache)
    assert cache.lengths == [3, 5] and cache.width == 5
    cache.begin_forward(4)
    nodes = torch.tensor([[10.0, 11, 12, 13], [20, 21, 22, 23]]).view(2, 1, 4, 1)
    cache.update(nodes, nodes.clone(), 0)
    cache.commit([[0, 2], [0, 1, 3]])
    assert cache.lengths == [5, 8] and cache.width == 8
    keys = cache.layers[0].keys[:, 0, :, 0]
    assert keys[0, :5].tolist() == [0, 1, 2, 10, 12]
    assert keys[1, :8].tolist() == [100, 101, 102, 103, 104, 20, 21, 23]
    cache.keep_rows([1])
    assert cache.lengths == [8] and cache.layers[0].keys[0, 0, :8, 0].tolist() == keys[1, :8].tolist()


def test_sampled_rows_keep_generates_distribution(peaked_model):  # noqa: F811
    """1,500 seeded rows decoded 50 at a time: the joint law of their first 3 tokens is generate()'s."""
    joint = exact_joint(peaked_model.base_model, temperature=1.0)
    engine = BatchDecoder(peaked_model, guard=False, max_batch_size=50, cost=FLAT)
    prompt = PROMPT[0].tolist()
    ids = [
        engine.add(prompt, NEW, do_sample=True, temperature=1.0, generator=torch.Generator().manual_seed(1000 + i))
        for i in range(1500)
    ]
    tokens: dict[int, list[int]] = {i: [] for i in ids}
    accepted = steps = 0
    while engine.has_work:
        for u in engine.step():
            tokens[u.request_id].extend(u.tokens)
            if u.finished:
                accepted += sum(a - 1 for a in u.accepted_lengths)
                steps += len(u.accepted_lengths)
    samples = [tuple(tokens[i]) for i in ids]
    assert all(len(s) == NEW for s in samples)
    pvalue, tv = chi2_pvalue(samples, joint)
    assert pvalue > 0.001, (pvalue, tv)
    assert accepted / steps > 0.3  # drafts were accepted, not only rejected


def test_generate_batch_helper():
    model, train = fitted_model("llama")
    outs = generate_batch(model, train, 20, decoder=BatchDecoder(model, guard=False, cost=CHEAP_TREES))
    assert outs == [solo(model, p, 20) for p in train]


def test_step_cost_measures_and_interpolates():
    model, _ = fitted_model("llama")
    cost = StepCost.measure(model, sizes=(1, 8, 32), context=16)
    assert len(cost.seconds) == 3 and all(s > 0 for s in cost.seconds) and cost.draft_seconds > 0
    assert cost.depth_seconds >= 0 and cost.draft(model.default_tree.depth) >= cost.draft(1)
    assert cost.row_share == 1.0  # these heads' rows draft one after another (no propose_dynamic_rows of their own)
    c = StepCost((1, 10), (1.0, 2.0), 0.0)
    assert c.forward(1) == 1.0 and c.forward(5.5) == pytest.approx(1.5) and c.forward(19) == pytest.approx(3.0)


def test_step_cost_saves_loads_and_refuses_what_is_not_a_curve(tmp_path):
    c = StepCost((1, 8, 64), (1e-3, 1.5e-3, 4e-3), 2e-4, depth_seconds=1e-4, row_share=0.3)
    c.save(tmp_path / "c.json")
    assert StepCost.load(tmp_path / "c.json") == c
    bad = {
        "not json": "{",
        "a list": "[1, 2]",
        "no drafting": '{"tokens": [1], "seconds": [0.1]}',
        "sizes not ascending": '{"tokens": [8, 1], "seconds": [0.1, 0.2], "draft_seconds": 0}',
        "one size short": '{"tokens": [1, 8], "seconds": [0.1], "draft_seconds": 0}',
        "zero seconds": '{"tokens": [1], "seconds": [0], "draft_seconds": 0}',
        "negative drafting": '{"tokens": [1], "seconds": [0.1], "draft_seconds": -1}',
    }
    for why, text in bad.items():
        (tmp_path / "bad.json").write_text(text)
        with pytest.raises(ValueError, match="bad.json"):
            StepCost.load(tmp_path / "bad.json")
            pytest.fail(why)


def test_probes_are_spaced_by_what_they_cost_the_whole_batch():
    """A probe pads every row's forward to its tree: alone or where nodes are free it comes every `probe_every`
    steps; where each node costs a token's share it comes only as often as keeps its cost under PROBE_SHARE,
    and a plain batch of 4 rows then decodes 40 tokens without a single probe tree (16 steps apart: two each)."""
    import dataclasses
    import math

    model, train = fitted_model("llama")
    free = BatchDecoder(model, cost=FLAT, prompt_lookup=False)
    assert free._probe_interval(1) == free._probe_interval(16) == free.probe_every == 16
    linear = BatchDecoder(model, cost=dataclasses.replace(LINEAR, draft_seconds=0.0), prompt_lookup=False)
    n = linear.probe_nodes
    assert n > 1
    assert linear._probe_interval(16) == math.ceil((n - 1) / PROBE_SHARE)  # forward(16 n) - forward(16) = (n-1) x 16
    _, finish = run(linear, train, 40)
    assert all(u.accepted_lengths and max(u.draft_tokens) == 0 for u in finish.values())
    assert not any(key[1] for key in linear._rate)  # no step counted as a speculative one


def test_an_engine_of_plain_rows_never_measures_the_cost_curve():
    """Distillation decodes plain rows only: no plan, no probes, so no forward-cost measurement at start."""
    model, train = fitted_model("llama")
    engine = BatchDecoder(model, guard=False)
    outs, _ = run(engine, train, 8, per_row=[{"speculative": False}] * len(train))
    assert engine._cost is None and outs == [solo(model, p, 8) for p in train]


def test_a_plain_plan_stands_until_the_rows_or_their_acceptance_change():
    """While a batch decodes plain nothing the plan reads changes, so it is not recomputed: only a row joining or
    leaving, or a new acceptance observation (a probe), makes the plan look again."""
    model, train = fitted_model("llama")
    engine = BatchDecoder(model, cost=LINEAR, prompt_lookup=False, probe_every=10**6)
    calls = []
    tree = engine._tree
    engine._tree = lambda row, budget: (budget > 1 and calls.append(row.rid)) or tree(row, budget)  # the plan's
    for p in train:
        engine.add(p, 40)
    engine.step()  # prefills, then plans for the 4 rows: plain
    assert len(engine.rows) == 4 and engine._plan() == 1
    seen = len(calls)
    assert seen > 0
    for _ in range(6):
        engine.step()
    assert len(calls) == seen and engine._plan() == 1  # same rows, no observation: the plan stood
    engine._observations += 1  # what a probe's verify does
    assert engine._plan() == 1 and len(calls) > seen


def test_guard_stops_speculating_at_a_batch_size_where_it_measured_slower():
    """The cost curve says speculate; the measured speed of 4-row batches says plain is faster: plain it is,
    except for the periodic retry; measured the other way round, the plan stands."""
    model, train = fitted_model("llama")
    engine = BatchDecoder(model, cost=CHEAP_TREES, probe_every=10**6)
    for p in train:
        engine.add(p, 40)
    engine.step()
    assert len(engine.rows) == 4
    engine._steps, engine._rate = 5, {}
    assert engine._plan() == 1  # no measurement of plain 4-row steps yet: measure it first
    engine._rate = {(4, False): 100.0, (4, True): 50.0}
    assert engine._plan() == 1
    engine._rate = {(4, False): 50.0, (4, True): 100.0}
    assert engine._plan() > 1
