"""MTP modules (and Medusa heads) trained from a feature cache: the same training without the backbone."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from test_train_support import (  # noqa: F401
    load_heads,
    make_config,
    read_metrics,
    sharpened_copy,
    stdlib_files,
    tiny_ckpt,
)

from mtp.train.config import ConfigError
from mtp.train.features import FeatureOptions, cache_features
from mtp.train.trainer import train

RUN = ("heads.head_type=mtp", "heads.num_heads=2", "loss.soft_targets=true", "train.max_steps=4", "optim.lr=3e-3",
       "data.eval_max_blocks=48")  # fmt: skip


@pytest.fixture(scope="module")
def base(tmp_path_factory, tiny_ckpt) -> Path:  # noqa: F811
    """The tiny Llama, sharpened (`sharpened_copy`) so that heads can learn."""
    return sharpened_copy(tiny_ckpt, tmp_path_factory.mktemp("sharp") / "tiny-llama")


@pytest.fixture(scope="module")
def cache(tmp_path_factory, base) -> Path:
    """The base's features over the same documents, packing and split as the trainer's data in RUN."""
    out = tmp_path_factory.mktemp("features") / "cache"
    cache_features(FeatureOptions(model=str(base), data=stdlib_files(), out=out, block_size=64, eval_fraction=0.1,
                                  eval_max_blocks=48, draft_vocab_size=200, batch_size=8, dtype="float32"))  # fmt: skip
    return out


class _CountForwards:
    """Counts forward calls of one module class anywhere (a global hook: the trainer builds its own model)."""

    def __init__(self, cls_name: str):
        self.cls_name, self.calls = cls_name, 0

    def __enter__(self) -> _CountForwards:
        def hook(module, args, output):
            self.calls += type(module).__name__ == self.cls_name

        self.handle = torch.nn.modules.module.register_module_forward_hook(hook)
        return self

    def __exit__(self, *exc) -> None:
        self.handle.remove()


def test_training_from_the_cache_matches_training_with_the_backbone(tmp_path, cache, base):
    """Same blocks, same batches, same losses (up to the cache's fp16 storage), same heads; the backbone
    runs once (the cache check) instead of in every step and evaluation."""
    online = tmp_path / "online"
    with _CountForwards("LlamaModel") as with_backbone:
        train(make_config(base, online, *RUN))
    offline = tmp_path / "offline"
    with _CountForwards("LlamaModel") as from_cache:
        train(make_config(base, offline, *RUN, "data.path=", f"data.features={cache}"))
    assert from_cache.calls == 1 and with_backbone.calls > 8
    a, b = read_metrics(online), read_metrics(offline)
    assert [m["step"] for m in a] == [m["step"] for m in b] == [1, 2, 3, 4]
    for x, y in zip(a, b, strict=True):
        assert y["loss"] == pytest.approx(x["loss"], rel=2e-3), (x, y)
    wa, wb = load_heads(online / "mtp_heads.safetensors"), load_heads(offline / "mtp_heads.safetensors")
    # Adam moves every weight by ~lr per step whatever its gradient's size, so a weight whose gradient is
    # near zero can step either way after fp16 rounding: compare the runs' difference with how far they moved.
    from transformers import AutoModelForCausalLM

    from mtp import MTPModel

    start = MTPModel.from_base(AutoModelForCausalLM.from_pretrained(base), num_heads=2, head_type="mtp")
    w0 = {k: v.float() for k, v in start.heads.state_dict().items()}
    for k in wa:
        moved = float((wa[k] - w0[k]).norm())
        assert float((wb[k] - wa[k]).norm()) <= 0.02 * moved, k
    # and the held-out evaluation from cached states scores what the backbone's states score
    ea, eb = (json.loads((d / "eval_accuracy.json").read_text())["heads"] for d in (online, offline))
    for x, y in zip(ea, eb, strict=True):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-3) and y["top5"] == pytest.approx(x["top5"], abs=2e-3)


def test_the_cache_must_come_from_this_base(tmp_path, cache, base):
    """Heads trained on another model's hidden states would be useless on this one: refused, with why."""
    from transformers import AutoModelForCausalLM

    other = tmp_path / "other"
    shutil.copytree(base, other)
    m = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with torch.no_grad():
        m.model.layers[1].mlp.down_proj.weight.mul_(3.0)  # a different fine-tune of the same architecture
    m.save_pretrained(other)
    with pytest.raises(ValueError, match="computed by another model"):
        train(make_config(other, tmp_path / "run", *RUN, "data.path=", f"data.features={cache}"))


def test_several_caches_train_together(tmp_path, cache, base):
    """data.features: [A, B] trains on both caches' blocks (nothing recomputed), and the held-out blocks are
    shared evenly between them; caches of different block sizes are refused."""
    from transformers import AutoModelForCausalLM

    from mtp.train.features import load_split, packed_from_features

    other = tmp_path / "other-cache"
    cache_features(FeatureOptions(model=str(base), data=stdlib_files(["textwrap.py"]), out=other, block_size=64,
                                  eval_fraction=0.2, draft_vocab_size=200, batch_size=8, dtype="float32"))  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    a, b = (load_split(d / "train", ("input_ids",))["input_ids"] for d in (cache, other))
    b_eval = load_split(other / "eval", ("input_ids",))["input_ids"]
    assert len(b_eval) >= 3
    both = packed_from_features([cache, other], model, eval_max_blocks=7)
    assert torch.equal(both.train_ids, torch.cat([a, b])) and both.train_hidden.shape[:2] == both.train_ids.shape
    assert torch.equal(both.eval_ids[4:], b_eval[:3]) and len(both.eval_ids) == 7  # 4 + 3: the first takes 7 % 2
    run = tmp_path / "run"
    train(make_config(base, run, *RUN, "data.path=", f"data.features=[{cache}, {other}]"))
    assert [m["step"] for m in read_metrics(run)] == [1, 2, 3, 4]

    longer = tmp_path / "longer-blocks"
    cache_features(FeatureOptions(model=str(base), data=stdlib_files(["textwrap.py"]), out=longer, block_size=128,
                                  eval_fraction=0.2, draft_vocab_size=200, batch_size=8, dtype="float32"))  # fmt: skip
    with pytest.raises(ValueError, match="one block size"):
        packed_from_features([cache, longer], model)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("mode=medusa2",), "needs mode: medusa1"),
        ((), "exclude each other"),
    ],
)
def test_feature_cache_config_is_checked(tmp_path, cache, tiny_ckpt, overrides, message):  # noqa: F811
    extra = () if overrides == () else ("data.path=",)
    with pytest.raises(ConfigError, match=message):
        make_config(tiny_ckpt, tmp_path / "run", *RUN, *extra, *overrides, f"data.features={cache}")


def test_draft_vocab_loss_is_the_teachers_distribution_over_those_tokens(base):
    """loss.draft_vocab: every head row's loss is the soft CE between the heads' and the teacher's
    distributions over the draft vocabulary's rows of the lm_head, checked against a direct computation;
    with every token id in the draft vocabulary it is exactly the ordinary loss."""
    from transformers import AutoModelForCausalLM

    from mtp import MTPModel
    from mtp.train.config import LossSection
    from mtp.train.objective import MTPTrainModule, head_rows

    torch.manual_seed(0)
    backbone = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    heads = MTPModel.from_base(backbone, num_heads=2, head_type="mtp").heads
    cfg = LossSection(soft_targets=True, soft_weight=1.0, decay=0.8)
    module = MTPTrainModule(backbone, heads, cfg)
    ids = torch.randint(0, 264, (2, 40))
    full = module(ids).loss.detach()
    module.set_draft_vocab(torch.arange(264))
    assert float(module(ids).loss.detach()) == pytest.approx(float(full), rel=1e-6)

    vocab = torch.arange(0, 264, 3)  # every third token
    module.set_draft_vocab(vocab)
    got = module(ids).loss.detach()
    hidden = module.hidden(ids, grad=False)
    feats = module.head_features(hidden, ids)
    w = backbone.lm_head.weight[vocab]
    want = 0.0
    for k in range(2):
        r = head_rows(feats[k], ids, torch.ones_like(ids, dtype=torch.bool), k, cfg.decay**k, hidden)
        teacher = torch.softmax(r.teacher @ w.T, -1)
        want += (r.weight * -(teacher * torch.log_softmax(r.x @ w.T, -1)).sum(-1)).sum()
    assert float(got) == pytest.approx(float(want.detach()), rel=1e-5)
    assert float(got) != pytest.approx(float(full), rel=1e-3)


def test_draft_vocab_training_saves_the_vocabulary_and_checks_its_config(tmp_path, cache, base):
    out = tmp_path / "run"
    vocab = json.loads((cache / "draft_vocab.json").read_text())
    train(make_config(base, out, *RUN, "data.path=", f"data.features={cache}", f"loss.draft_vocab={cache}"))
    from mtp import MTPModel

    trained = MTPModel.from_pretrained(out)
    assert trained.draft_vocab.tolist() == sorted(vocab)
    trained.set_draft_vocab(None)
    trained.save_pretrained(tmp_path / "no-vocab", heads_only=True)
    for bad, message in [("loss.soft_weight=0.5", "soft_weight: 1.0"), ("heads.own_lm_head=true", "own_lm_head")]:
        with pytest.raises(ConfigError, match=message):
            make_config(base, out, *RUN, f"loss.draft_vocab={cache}", bad)
    with pytest.raises(ConfigError, match="no draft vocabulary"):
        train(make_config(base, tmp_path / "r2", *RUN, f"loss.draft_vocab={tmp_path / 'no-vocab'}"))


def test_heads_are_also_scored_against_the_bases_greedy_token(base):
    """evaluate's greedy_top1/greedy_top5: how often head k's guesses at position t include the base's own
    greedy token at position t+k+1 (what a draft must match to be accepted), on the positions whose token
    t+k+2 is a target, checked against a direct count."""
    from transformers import AutoModelForCausalLM

    from mtp import MTPModel
    from mtp.train.config import LossSection
    from mtp.train.distributed import DistEnv
    from mtp.train.evaluation import evaluate
    from mtp.train.objective import MTPTrainModule

    torch.manual_seed(0)
    backbone = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    heads = MTPModel.from_base(backbone, num_heads=2, head_type="mtp").heads
    module = MTPTrainModule(backbone, heads, LossSection(soft_targets=True))
    ids = torch.randint(0, 264, (6, 48))
    mask = torch.rand(6, 48) < 0.7
    res = evaluate(module, ids, mask, batch_size=2, env=DistEnv(), chunk_size=16)
    with torch.no_grad():
        hidden = module.hidden(ids, grad=False)
        greedy = backbone.lm_head(hidden).argmax(-1)  # (B, T): the base's choice for the next position
        feats = module.head_features(hidden, ids)
        for k, h in enumerate(res.heads):
            s = k + 2
            top = backbone.lm_head(feats[k, :, : 48 - s]).topk(5, dim=-1).indices  # (B, T-s, 5)
            ref = greedy[:, k + 1 : 48 - 1]
            rows = mask[:, s:]
            want1 = (top[..., 0] == ref)[rows].double().mean()
            want5 = (top == ref[..., None]).any(-1)[rows].double().mean()
            assert h.greedy_top1 == pytest.approx(float(want1), abs=1e-9)
            assert h.greedy_top5 == pytest.approx(float(want5), abs=1e-9)
            assert 0 < h.greedy_top5 < 1
            # the count tells positions apart: one position off, it would be another number
            shifted = (top == greedy[:, k : 48 - 2, None]).any(-1)[rows].double().mean()
            assert h.greedy_top5 != pytest.approx(float(shifted), abs=1e-6)
