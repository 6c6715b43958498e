"""Offline drafter training: feature cache, learning, exact resume (also after SIGKILL), a loadable export."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_train_support import sharpened_copy, stdlib_files, tiny_ckpt  # noqa: F401

from mtp.train.drafter_trainer import DrafterOptions, train_drafter
from mtp.train.features import FeatureOptions, cache_features


@pytest.fixture(scope="module")
def features(tmp_path_factory, tiny_ckpt):  # noqa: F811
    """Features of the tiny Llama, sharpened (`sharpened_copy`) so that there is something to learn."""
    tiny_ckpt = sharpened_copy(tiny_ckpt, tmp_path_factory.mktemp("sharp") / "tiny-llama")
    out = tmp_path_factory.mktemp("features") / "cache"
    info = cache_features(
        FeatureOptions(model=str(tiny_ckpt), data=stdlib_files(), out=out, block_size=128, eval_fraction=0.1,
                       eval_max_blocks=8, draft_vocab_size=200, batch_size=8, shard_blocks=16, dtype="float32")
    )  # fmt: skip
    return tiny_ckpt, out, info


def _opts(model: Path, feats: Path, out: Path, **kw) -> DrafterOptions:
    base = dict(features=feats, out=out, model=str(model), num_heads=4, steps=3, lr=3e-3, warmup_steps=5,
                micro_batch=8, max_steps=12, eval_every=1000, save_every=3, seed=0)  # fmt: skip
    return DrafterOptions(**{**base, **kw})


def test_feature_cache_is_complete_and_resumable(features):
    model, out, info = features
    assert info["train_blocks"] > 8 and info["eval_blocks"] > 0
    assert info["feature_layers"] == [1]  # a 2-layer base: the input of its last layer
    vocab = json.loads((out / "draft_vocab.json").read_text())
    assert len(vocab) == info["draft_vocab_size"] <= 200 and vocab == sorted(set(vocab))
    shards = sorted((out / "train").glob("shard-*"))
    assert len(shards) >= 2
    # the cached features are what the base computes
    from datasets import load_from_disk
    from transformers import AutoModelForCausalLM

    row = load_from_disk(str(shards[0])).with_format("numpy")[0]
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        o = base(torch.tensor(row["input_ids"][None]).long(), output_hidden_states=True)
    torch.testing.assert_close(torch.from_numpy(row["aux"]).float(), o.hidden_states[1][0], atol=2e-3, rtol=1e-3)
    torch.testing.assert_close(torch.from_numpy(row["final"]).float(), o.hidden_states[-1][0], atol=2e-3, rtol=1e-3)
    assert (torch.from_numpy(row["target"]).long() == o.logits[0].argmax(-1)).float().mean() > 0.99
    # a rerun finds every shard finished and recomputes nothing
    again = cache_features(FeatureOptions(model=str(model), data=stdlib_files(), out=out, block_size=128,
                                          eval_fraction=0.1, eval_max_blocks=8, draft_vocab_size=200,
                                          batch_size=8, shard_blocks=16, dtype="float32"))  # fmt: skip
    assert again["tokens_computed"] == 0 and again["complete"]


def test_training_reads_the_cache_from_disk_block_by_block(features):
    """The trainer's memory-mapped reader returns, for any order of blocks across shards, the same tokens,
    masks, targets and feature values as loading the split whole (a 1M-token cache loaded whole took 18 GB)."""
    from mtp.train.features import FeatureRows, load_split

    _, out, _ = features
    whole, rows = load_split(out / "train"), FeatureRows(out / "train")
    n = whole["input_ids"].shape[0]
    assert len(rows) == n > 17 and rows.block_size == whole["input_ids"].shape[1]  # more than one shard
    index = [n - 1, 0, 17, 3, 17]
    got = rows.rows(index)
    for name, value in whole.items():
        assert got[name].dtype == value.dtype or name in ("aux", "final")
        torch.testing.assert_close(got[name].float(), value[index].float(), rtol=0, atol=0)


def test_a_cache_still_being_computed_trains_on_its_finished_shards(tmp_path, features):
    """The eval split and the info file come first, so a half-computed cache (killed, or still running) is
    already a training set: the drafter reads the finished train shards and says how many it used."""
    model, feats, info = features
    partial = tmp_path / "partial"
    shutil.copytree(feats, partial)
    shards = sorted((partial / "train").glob("shard-*"))
    for extra in shards[1:]:
        shutil.rmtree(extra)
    (partial / "train" / "shard-00001.tmp").mkdir()  # a shard being written is not read
    meta = json.loads((partial / "features_info.json").read_text())
    (partial / "features_info.json").write_text(json.dumps({**meta, "complete": False}))
    res = train_drafter(_opts(model, partial, tmp_path / "run", max_steps=2, save_every=2))
    assert res["train_blocks_used"] == 16 < info["train_blocks"]  # shard_blocks=16: the first shard only


def test_a_cache_can_stop_at_a_chosen_size(tmp_path, features):
    """--max-train-blocks computes a prefix of the full cache: the same first shard, the same vocabulary."""
    from datasets import load_from_disk

    model, full, info = features
    out = tmp_path / "prefix"
    small = cache_features(FeatureOptions(model=str(model), data=stdlib_files(), out=out, block_size=128,
                                          eval_fraction=0.1, eval_max_blocks=8, draft_vocab_size=200, batch_size=8,
                                          shard_blocks=16, dtype="float32", max_train_blocks=16))  # fmt: skip
    assert small["complete"] and small["train_blocks"] == 16 < small["train_blocks_available"] == info["train_blocks"]
    assert [p.name for p in (out / "train").iterdir()] == ["shard-00000"]
    assert (out / "draft_vocab.json").read_text() == (full / "draft_vocab.json").read_text()
    a = load_from_disk(str(out / "train" / "shard-00000")).with_format("numpy")[:]
    b = load_from_disk(str(full / "train" / "shard-00000")).with_format("numpy")[:]
    assert (a["input_ids"] == b["input_ids"]).all() and (a["final"] == b["final"]).all()


def test_several_caches_train_together(tmp_path, features):
    """--features A B: one run over both caches' train blocks (A's, then B's), evaluated on both eval splits."""
    from mtp.train.drafter_trainer import main
    from mtp.train.features import FeatureRows, load_split

    model, full, info = features
    small = tmp_path / "small"
    cache_features(FeatureOptions(model=str(model), data=stdlib_files(), out=small, block_size=128,
                                  eval_fraction=0.1, eval_max_blocks=8, draft_vocab_size=200, batch_size=8,
                                  shard_blocks=16, dtype="float32", max_train_blocks=16))  # fmt: skip
    both = FeatureRows([full / "train", small / "train"])
    assert len(both) == info["train_blocks"] + 16
    one, other = FeatureRows(full / "train").rows([3]), FeatureRows(small / "train").rows([5])
    for k, v in both.rows([3, info["train_blocks"] + 5]).items():
        assert torch.equal(v[0], one[k][0]) and torch.equal(v[1], other[k][0])
    held = load_split([full / "eval", small / "eval"], ("input_ids",))["input_ids"]
    assert len(held) == len(load_split(full / "eval", ("input_ids",))["input_ids"]) + len(
        load_split(small / "eval", ("input_ids",))["input_ids"]
    )

    out = tmp_path / "run"
    assert main(["--features", str(full), str(small), "--out", str(out), "--model", str(model), "--num-heads", "2",
                 "--steps", "2", "--micro-batch", "8", "--max-steps", "2", "--save-every", "2"]) == 0  # fmt: skip
    result = json.loads((out / "result.json").read_text())
    assert result["train_blocks_used"] == len(both) and result["options"]["features"] == [str(full), str(small)]

    other_blocks = tmp_path / "other"
    shutil.copytree(small, other_blocks)
    meta = json.loads((other_blocks / "features_info.json").read_text())
    meta["options"]["block_size"] = 64
    (other_blocks / "features_info.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="same feature layers and block size"):
        train_drafter(_opts(model, [full, other_blocks], tmp_path / "refused", max_steps=1))


def test_drafter_learns_every_depth(tmp_path, features):
    model, feats, _ = features
    res = train_drafter(_opts(model, feats, tmp_path / "run", max_steps=80, eval_every=80, save_every=80))
    before, after = res["untrained"]["top1"], res["heldout"]["top1"]
    assert len(after) == 3
    assert after[0] > before[0] + 0.10, (before, after)
    for j in range(1, 3):  # the training-time test trains the drafter's own deeper steps too
        assert after[j] > before[j] + 0.05, (before, after)
    # the export is an MTP checkpoint every command loads
    from mtp import MTPModel

    exported = MTPModel.from_pretrained(tmp_path / "run" / "drafter")
    assert exported.config.head_type == "eagle"
    assert exported.heads.draft_vocab_size == json.loads((feats / "draft_vocab.json").read_text()).__len__()
    # the per-cache benchmark scores the exported drafter as the trainer's own evaluation did
    from mtp.bench.cache_accuracy import cache_accuracy, main

    rows = list(cache_accuracy([tmp_path / "run" / "drafter"], [feats], steps=3))
    assert [r["features"] for r in rows] == [str(feats)] and rows[0]["tokens"] == res["heldout"]["tokens"]
    assert rows[0]["top1"] == pytest.approx(after, abs=0.02)
    with pytest.raises(SystemExit):  # a directory that is not a feature cache is refused before loading
        main(["--heads", str(tmp_path / "run" / "drafter"), "--features", str(tmp_path)])


def test_resume_is_exact(tmp_path, features):
    model, feats, _ = features
    straight = tmp_path / "straight"
    train_drafter(_opts(model, feats, straight))
    stopped = tmp_path / "stopped"
    r = train_drafter(_opts(model, feats, stopped, stop_after=6))
    assert r["stop_reason"] == "stop_after" and not (stopped / "drafter").exists()
    train_drafter(_opts(model, feats, stopped))
    a = load_file(str(straight / "checkpoint-12" / "drafter.safetensors"))
    b = load_file(str(stopped / "checkpoint-12" / "drafter.safetensors"))
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)
    loss = [json.loads(x)["loss"] for x in (straight / "metrics.jsonl").read_text().splitlines()]
    resumed = [json.loads(x)["loss"] for x in (stopped / "metrics.jsonl").read_text().splitlines()]
    assert resumed == pytest.approx(loss)


def test_kill_and_resume(tmp_path, features):
    """SIGKILL a real training process; rerunning the same command continues the uninterrupted run."""
    model, feats, _ = features
    killed = tmp_path / "killed"
    cmd = [sys.executable, "-m", "mtp.train.drafter_trainer", "--features", str(feats), "--out", str(killed),
           "--model", str(model), "--num-heads", "4", "--steps", "3", "--lr", "3e-3", "--warmup-steps", "5",
           "--micro-batch", "8", "--max-steps", "400", "--eval-every", "1000", "--save-every", "2",
           "--threads", "1"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 180
        while not (killed / "checkpoint-4" / "state.json").is_file():
            assert proc.poll() is None, "training process died before its first checkpoints"
            assert time.time() < deadline, "no checkpoint-4 after 180 s"
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    last = max(int(p.name.split("-")[1]) for p in killed.glob("checkpoint-*") if (p / "state.json").exists())
    target = last + 2
    train_drafter(_opts(model, feats, killed, max_steps=400, save_every=2, stop_after=target))
    straight = tmp_path / "straight"
    train_drafter(_opts(model, feats, straight, max_steps=400, save_every=2, stop_after=target))
    a = load_file(str(straight / f"checkpoint-{target}" / "drafter.safetensors"))
    b = load_file(str(killed / f"checkpoint-{target}" / "drafter.safetensors"))
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)


def test_init_from_warm_starts_a_new_run(tmp_path, features):
    """A new run from an earlier drafter starts from its weights (checkpoint or export), with a fresh
    schedule, and keeps the drafter's draft vocabulary on a cache that would choose another."""
    model, feats, _ = features
    first = tmp_path / "first"
    train_drafter(_opts(model, feats, first, max_steps=40, eval_every=40, save_every=40))
    warm = train_drafter(_opts(model, feats, tmp_path / "warm", init_from=first / "checkpoint-40", max_steps=3))
    cold = json.loads((first / "eval_untrained.json").read_text())["top1"]
    trained = json.loads((first / "result.json").read_text())["heldout"]["top1"]
    # the warm run's step-0 evaluation is the first run's final one, far above an untrained drafter
    assert warm["untrained"]["top1"] == pytest.approx(trained, abs=1e-3)
    assert warm["untrained"]["top1"][0] > cold[0] + 0.05
    first_lr = json.loads((tmp_path / "warm" / "metrics.jsonl").read_text().splitlines()[0])["lr"]
    assert first_lr == pytest.approx(3e-3 / 5)  # warmup starts again
    # the bf16 export works as a starting point too
    from_export = train_drafter(_opts(model, feats, tmp_path / "exp", init_from=first / "drafter", max_steps=1))
    assert from_export["untrained"]["top1"][0] > cold[0] + 0.05
    # a cache with another draft vocabulary (a bigger cache's frequent tokens differ): the warm run keeps the
    # drafter's own, so its projection rows keep meaning the same tokens and its step-0 eval is unchanged
    from mtp.train.features import VOCAB

    other = tmp_path / "other-cache"
    shutil.copytree(feats, other)
    ids = json.loads((feats / VOCAB).read_text())
    (other / VOCAB).write_text(json.dumps(ids[: len(ids) // 2]))
    kept = train_drafter(_opts(model, other, tmp_path / "kept", init_from=first / "checkpoint-40", max_steps=2))
    assert kept["untrained"]["top1"] == pytest.approx(trained, abs=1e-3)
    source_ids = load_file(str(first / "checkpoint-40" / "drafter.safetensors"))["draft_ids"]
    for where in ("checkpoint-2/drafter.safetensors", "drafter/mtp_heads.safetensors"):
        assert torch.equal(load_file(str(tmp_path / "kept" / where))["draft_ids"], source_ids), where
    # rerunning the finished command resumes from its checkpoint, with the same vocabulary
    again = train_drafter(_opts(model, other, tmp_path / "kept", init_from=first / "checkpoint-40", max_steps=2))
    assert again["heldout"]["top1"] == pytest.approx(kept["heldout"]["top1"], abs=1e-6)


def test_a_deeper_drafter_grows_from_a_shallower_one(tmp_path, features):
    """--num-layers 2 --init-from a 1-layer run: the stacked layer starts as the identity, so the new run's
    step-0 evaluation is the source's final one; training then changes that layer, and its export reloads as a
    2-layer drafter. Resuming it with another layer count, or growing a shallower one from it, is refused."""
    model, feats, _ = features
    first = tmp_path / "first"
    train_drafter(_opts(model, feats, first, max_steps=30, eval_every=30, save_every=30))
    trained = json.loads((first / "result.json").read_text())["heldout"]["top1"]
    deep = tmp_path / "deep"
    res = train_drafter(_opts(model, feats, deep, num_layers=2, init_from=first / "checkpoint-30", max_steps=20,
                              eval_every=20, save_every=10))  # fmt: skip
    assert res["untrained"]["top1"] == pytest.approx(trained, abs=1e-4)
    assert res["heldout"]["top1"][0] >= trained[0] - 0.02  # training from there does not lose what it had
    w = load_file(str(deep / "checkpoint-20" / "drafter.safetensors"))
    assert w["extra_layers.0.self_attn.o_proj.weight"].abs().max() > 0  # the stacked layer learned
    from mtp import MTPModel

    exported = MTPModel.from_pretrained(deep / "drafter")
    assert exported.heads.num_layers == 2 and exported.config.head_kwargs["num_layers"] == 2
    with pytest.raises(ValueError, match="holds a 2-layer drafter, this run builds 1"):
        train_drafter(_opts(model, feats, deep, max_steps=30))
    with pytest.raises(ValueError, match="more layers than this one"):
        train_drafter(_opts(model, feats, tmp_path / "shallow", init_from=deep / "checkpoint-20", max_steps=1))


def _fresh_drafter_and_batch(features) -> tuple:
    """A fresh three-depth fp32 drafter over the tiny cache's draft vocabulary (seed 0), the teacher's projection
    onto that vocabulary, and the first four eval blocks: what the depth_losses tests compute on."""
    from mtp.heads import build_heads
    from mtp.train.drafter_trainer import _batch
    from mtp.train.features import VOCAB, load_base, load_split

    model, feats, info = features
    base, _ = load_base(str(model), torch.float32)
    vocab = torch.tensor(json.loads((feats / VOCAB).read_text()))
    torch.manual_seed(0)
    drafter = build_heads("eagle", base_model=base, hidden_size=base.config.hidden_size,
                          vocab_size=base.config.vocab_size, num_heads=3, feature_layers=info["feature_layers"],
                          draft_vocab_size=len(vocab))  # fmt: skip
    drafter.set_draft_vocab(vocab, base)
    teacher_w = base.get_output_embeddings().weight.detach()[vocab].float()
    return drafter.float(), teacher_w, _batch(load_split(feats / "eval"), [0, 1, 2, 3])


def test_training_scores_only_the_entries_that_carry_loss(features, monkeypatch):
    """A training step projects only the scored entries to the draft vocabulary and computes the teacher only
    where some depth reads it; its per-depth losses, top-1 counts and gradients equal the plain computation
    over every position (here with a third of the targets masked out, as prompts are in chat data)."""
    import contextlib

    import torch.nn.functional as F

    from mtp.train.drafter_trainer import depth_losses

    monkeypatch.setattr("mtp.train.drafter_trainer.autocast", contextlib.nullcontext)  # fp32 on any CPU
    drafter, teacher_w, batch = _fresh_drafter_and_batch(features)
    drafter.train()
    keep = torch.rand(batch["loss_mask"].shape, generator=torch.Generator().manual_seed(0)) > 0.33
    batch["loss_mask"] = batch["loss_mask"] & keep
    params = [p for p in drafter.parameters() if p.requires_grad]
    steps = 3
    losses, acc = depth_losses(drafter, teacher_w, batch, steps)
    got = torch.autograd.grad(sum(losses), params, allow_unused=True)

    ids, mask, target, final = batch["input_ids"], batch["loss_mask"], batch["target"], batch["final"]
    T = ids.shape[1]
    teacher_all = F.softmax(final[:, 1 : T - 1].float() @ teacher_w.T, dim=-1)
    want_losses = []
    for j, logits in enumerate(drafter.unroll(batch["aux"].float(), ids, steps)):
        L = T - j - 2
        valid = mask[:, j + 2 : j + 2 + L]
        student = logits[:, :L][valid]
        want_losses.append(-(teacher_all[:, j : j + L][valid] * F.log_softmax(student, -1)).sum(-1).mean())
        correct = int((drafter.draft_ids[student.argmax(-1)] == target[:, j + 1 : j + 1 + L][valid]).sum())
        assert acc[j] == (correct, int(valid.sum())) and 0 < acc[j][1] < valid.numel()
    torch.testing.assert_close(torch.stack(losses), torch.stack(want_losses))
    want = torch.autograd.grad(sum(want_losses), params, allow_unused=True)
    for a, b in zip(got, want, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_the_greedy_target_term_adds_its_weighted_cross_entropy(features, monkeypatch):
    """`hard_weight` adds, per depth, that weight times the cross-entropy against the base's greedy token,
    over the scored entries whose greedy token the draft vocabulary holds (the others keep the soft term
    only); evaluation never adds it."""
    import contextlib

    import torch.nn.functional as F

    from mtp.train.drafter_trainer import RANKS, depth_losses
    from mtp.train.features import VOCAB

    monkeypatch.setattr("mtp.train.drafter_trainer.autocast", contextlib.nullcontext)
    drafter, teacher_w, batch = _fresh_drafter_and_batch(features)
    drafter.eval()
    vocab = json.loads((features[1] / VOCAB).read_text())  # the cache's own list, not the drafter's copy
    steps, w = 3, 0.7
    soft, _ = depth_losses(drafter, teacher_w, batch, steps)
    mixed, _ = depth_losses(drafter, teacher_w, batch, steps, hard_weight=w)
    ids, mask, target = batch["input_ids"], batch["loss_mask"], batch["target"]
    T = ids.shape[1]
    where = {int(t): i for i, t in enumerate(vocab)}
    outside = 0
    for j, logits in enumerate(drafter.unroll(batch["aux"].float(), ids, steps)):
        L = T - j - 2
        valid = mask[:, j + 2 : j + 2 + L]
        student, greedy = logits[:, :L][valid], target[:, j + 1 : j + 1 + L][valid]
        held = torch.tensor([int(g) in where for g in greedy])
        outside += int((~held).sum())
        index = torch.tensor([where[int(g)] for g in greedy[held]])
        hard = F.nll_loss(F.log_softmax(student[held], -1), index)
        torch.testing.assert_close(mixed[j], soft[j] + w * hard)
    assert outside > 0  # the tiny cache's draft vocabulary misses some greedy tokens: they are skipped
    counts = [torch.zeros(RANKS + 1, dtype=torch.long) for _ in range(steps)]
    evaluated, _ = depth_losses(drafter, teacher_w, batch, steps, None, counts, hard_weight=w)
    torch.testing.assert_close(torch.stack(evaluated), torch.stack(soft))


def test_conditional_rank_probabilities_follow_the_draft_chain(tmp_path, features):
    """cond_rank_probs counts depth j only where depths < j drafted the teacher's token (which the text then
    continues with), checked against a loop over positions; the export hands them to the tree builder."""
    from mtp.train.drafter_trainer import RANKS, _batch, default_tree_size, depth_losses
    from mtp.train.features import VOCAB, load_split
    from mtp.train.precision import autocast

    model, feats, _ = features
    run = tmp_path / "run"
    train_drafter(_opts(model, feats, run, max_steps=60, eval_every=60, save_every=60))
    from mtp import MTPModel

    m = MTPModel.from_pretrained(run / "drafter")
    drafter = m.heads.float().eval()
    vocab = torch.tensor(json.loads((feats / VOCAB).read_text()))
    teacher_w = m.base_model.get_output_embeddings().weight.detach()[vocab].float()
    held = load_split(feats / "eval")
    batch = _batch(held, list(range(min(4, held["input_ids"].shape[0]))))
    steps = 3
    counts = [torch.zeros(RANKS + 1, dtype=torch.long) for _ in range(steps)]
    with torch.no_grad():
        depth_losses(drafter, teacher_w, batch, steps, None, counts)
        with autocast():  # the trainer's own precision on this CPU
            logits = drafter.unroll(batch["aux"].float(), batch["input_ids"], steps)
    ids, target, mask = batch["input_ids"], batch["target"], batch["loss_mask"]
    B, T = ids.shape
    expect = [torch.zeros(RANKS + 1, dtype=torch.long) for _ in range(steps)]
    for b in range(B):
        for t in range(T):
            for j in range(steps):
                if t + j + 2 >= T or not mask[b, t + j + 2]:
                    break
                row = logits[j][b, t].float()
                greedy = int(target[b, t + j + 1])
                top = drafter.draft_ids[row.topk(RANKS).indices].tolist()
                expect[j][top.index(greedy) if greedy in top else RANKS] += 1
                if top[0] != greedy or int(ids[b, t + j + 2]) != greedy:
                    break  # the chain stops: deeper depths at t would never be verified
    for j in range(steps):
        assert torch.equal(counts[j], expect[j]), (j, counts[j], expect[j])
    assert int(expect[1].sum()) < int(expect[0].sum())
    # the export reads the conditional probabilities; --export-only redoes it from the last checkpoint
    shutil.rmtree(run / "drafter")
    res = train_drafter(_opts(model, feats, run, max_steps=60, export_only=True))
    assert res["stop_reason"] == "export_only" and res["steps"] == 60
    cfg = json.loads((run / "drafter" / "mtp_config.json").read_text())
    assert cfg["head_accuracies"] == res["heldout"]["cond_rank_probs"]
    assert cfg["tree_nodes"] == default_tree_size(cfg["head_accuracies"])
    assert res["heldout"]["cond_counts"][0] > res["heldout"]["cond_counts"][-1]
