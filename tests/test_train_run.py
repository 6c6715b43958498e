"""End-to-end training runs on a tiny model: learning, exact resume (also after a real kill), torchrun DDP."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_train_support import REPO, load_heads, make_config, read_metrics, stdlib_files, tiny_ckpt, write_config  # noqa: F401

from mtp import MTPModel
from mtp.train.trainer import train


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    return {**env, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def test_heads_learn_stdlib_code(tmp_path, tiny_ckpt):  # noqa: F811
    """Trained heads beat the untrained heads by far, and the unigram baseline, on held-out code."""
    out = tmp_path / "run"
    cfg = make_config(
        tiny_ckpt, out, "heads.own_lm_head=true", "data.block_size=128", "train.micro_batch_size=8",
        "train.max_steps=250", "train.log_every=50",
    )  # fmt: skip
    train(cfg)
    acc = json.loads((out / "eval_accuracy.json").read_text())
    head1, untrained1 = acc["heads"][0], acc["untrained"]["heads"][0]

    from mtp.train.data import prepare_data
    from mtp.train.tiny import byte_tokenizer

    held_out = prepare_data(cfg.data, byte_tokenizer(), 264, cfg.train.seed).eval_ids[:, 2:].reshape(-1)
    freq = torch.bincount(held_out, minlength=264).double() / held_out.numel()  # the best context-free guess
    assert head1["top1"] > untrained1["top1"] + 0.20
    assert head1["top1"] > float(freq.max()) + 0.01
    assert head1["top5"] > float(freq.topk(5).values.sum()) + 0.05
    # the output dir is a heads-only MTP checkpoint whose config carries per-rank probabilities
    model = MTPModel.from_pretrained(out)
    ranks = model.config.head_accuracies
    assert len(ranks) == 3 and len(ranks[0]) == 8
    assert ranks[0][0] == pytest.approx(head1["top1"], abs=1e-5)
    assert sum(ranks[0][:5]) == pytest.approx(head1["top5"], abs=1e-4) and sum(ranks[0]) <= 1.0
    ce = [m["ce_head1"] for m in read_metrics(out)]
    assert ce[-1] < ce[0] and ce[-1] < untrained1["loss"] - 1.0


def test_resume_is_exact_medusa2(tmp_path, tiny_ckpt):  # noqa: F811
    """Stop after step 5 and resume: same weights, same loss curve as a straight run.

    Medusa-2 with LoRA dropout, a heads warm-up that ends before the stop, and gradient accumulation: the
    resumed run needs the optimizer (both groups), the lr schedule position and the RNG state to match.
    """
    common = ("mode=medusa2", "lora.r=4", "lora.dropout=0.2", "lora.warmup_heads_steps=3", "lora.lr=1e-3",
              "train.max_steps=8", "train.grad_accum=2", "train.eval_at_start=false")  # fmt: skip
    straight = tmp_path / "straight"
    train(make_config(tiny_ckpt, straight, *common))
    stopped = tmp_path / "stopped"
    train(make_config(tiny_ckpt, stopped, *common, "train.stop_after_steps=5"))
    assert (stopped / "checkpoint-5" / "trainer_state.json").is_file()
    assert not (stopped / "heads.safetensors").exists()  # not finished yet
    train(make_config(tiny_ckpt, stopped, *common))  # resume: auto

    for name in ("heads.safetensors", "adapter/adapter_model.safetensors"):
        a, b = load_heads(straight / name), load_heads(stopped / name)
        assert a.keys() == b.keys()
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)
    assert [m["loss"] for m in read_metrics(straight)] == pytest.approx([m["loss"] for m in read_metrics(stopped)])
    assert [m["step"] for m in read_metrics(stopped)] == list(range(1, 9))
    # every weights file (checkpoint heads, LoRA adapter, final heads) is readable like the JSON beside it,
    # not owner-only as safetensors writes it
    from mtp.files import current_umask

    weights = list(stopped.rglob("*.safetensors"))
    assert len(weights) >= 4
    assert {stat.S_IMODE(p.stat().st_mode) for p in weights} == {0o666 & ~current_umask()}


def test_kill_and_resume(tmp_path, tiny_ckpt):  # noqa: F811
    """SIGKILL a real training process mid-run; the resumed run continues the uninterrupted one exactly."""
    common = ("train.max_steps=2000", "train.save_every=2", "train.save_total_limit=3", "train.eval_at_start=false")
    killed = tmp_path / "killed"
    config = write_config(tmp_path / "c.yaml", tiny_ckpt, killed, *common)
    proc = subprocess.Popen([sys.executable, str(REPO / "train" / "run.py"), "--config", str(config)],
                            env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.time() + 120
        while not (killed / "checkpoint-4" / "trainer_state.json").is_file():
            assert proc.poll() is None, "training process died before its first checkpoints"
            assert time.time() < deadline, "no checkpoint-4 after 120 s"
            time.sleep(0.02)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    from mtp.train.checkpointing import list_checkpoints

    last = list_checkpoints(killed)[-1][0]
    target = last + 4
    train(make_config(tiny_ckpt, killed, *common, f"train.stop_after_steps={target}"))
    straight = tmp_path / "straight"
    train(make_config(tiny_ckpt, straight, *common, f"train.stop_after_steps={target}"))
    a = load_heads(straight / f"checkpoint-{target}" / "heads.safetensors")
    b = load_heads(killed / f"checkpoint-{target}" / "heads.safetensors")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)
    curve = [m["loss"] for m in read_metrics(killed)]
    assert len(curve) == target
    assert curve == pytest.approx([m["loss"] for m in read_metrics(straight)])


def test_torchrun_two_processes(tmp_path, tiny_ckpt):  # noqa: F811
    """2 gloo ranks x micro-batch 2 == 1 process x micro-batch 4: identical heads on both ranks and vs 1 rank."""
    common = ("train.max_steps=12", "train.eval_at_start=false", "optim.warmup_steps=0")
    ddp = tmp_path / "ddp"
    config = write_config(tmp_path / "c.yaml", tiny_ckpt, ddp, *common, "train.micro_batch_size=2")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(REPO / "train" / "run.py"), "--config", str(config)]  # fmt: skip
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    state = json.loads((ddp / "trainer_state.json").read_text())
    assert state["world_size"] == 2
    assert len(state["rank_checksums"]) == 2 and len(set(state["rank_checksums"])) == 1
    losses = [m["loss"] for m in read_metrics(ddp)]
    assert losses[-1] < losses[0]

    single = tmp_path / "single"
    train(make_config(tiny_ckpt, single, *common, "train.micro_batch_size=4"))
    a, b = load_heads(ddp / "mtp_heads.safetensors"), load_heads(single / "mtp_heads.safetensors")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)
    assert losses == pytest.approx([m["loss"] for m in read_metrics(single)], rel=1e-4)


@pytest.mark.slow  # ~35 s: launcher + DeepSpeed start-up dominate; CI runs it (the train extra installs deepspeed)
def test_deepspeed_zero3_launcher(tmp_path, tiny_ckpt):  # noqa: F811
    """The `deepspeed` launcher on CPU (gloo): ZeRO-3 follows the same loss curve as a plain run."""
    pytest.importorskip("deepspeed")
    common = ("train.max_steps=6", "train.eval_at_start=false", "optim.warmup_steps=0", "train.save_every=3")
    ds = tmp_path / "ds"
    config = write_config(tmp_path / "c.yaml", tiny_ckpt, ds, *common, "train.micro_batch_size=2",
                          f"deepspeed={REPO / 'configs' / 'ds_zero3.json'}")  # fmt: skip
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(_port()),
           str(REPO / "train" / "run.py"), "--config", str(config)]  # fmt: skip
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert (ds / "checkpoint-6" / "deepspeed").is_dir()
    single = tmp_path / "single"
    train(make_config(tiny_ckpt, single, *common, "train.micro_batch_size=4"))
    assert [m["loss"] for m in read_metrics(ds)] == pytest.approx([m["loss"] for m in read_metrics(single)], rel=1e-4)
    a, b = load_heads(ds / "mtp_heads.safetensors"), load_heads(single / "mtp_heads.safetensors")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)


def test_wandb_offline(tmp_path, tiny_ckpt, monkeypatch):  # noqa: F811
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    out = tmp_path / "wb"
    train(make_config(tiny_ckpt, out, "train.max_steps=2", "tracking.report_to=wandb", "train.eval_at_start=false"))
    assert os.environ.get("WANDB_MODE") == "offline"
    assert list((out / "wandb").glob("offline-run-*")), "no offline wandb run written"


def _port() -> int:
    from test_train_support import free_port

    return free_port()


def test_stdlib_files_exist():
    assert len(stdlib_files()) == 5 and all(Path(f).stat().st_size > 1000 for f in stdlib_files())


def test_time_boxed_run_finishes_with_servable_heads(tmp_path, tiny_ckpt):  # noqa: F811
    """train.max_minutes ends a run as a finished one (what `mtp quickstart --train-minutes` relies on)."""
    out = tmp_path / "boxed"
    train(make_config(tiny_ckpt, out, "train.max_steps=100000", "train.max_minutes=0.02", "train.eval_at_start=false"))
    steps = [m["step"] for m in read_metrics(out) if "step" in m]
    assert 0 < max(steps) < 100000
    assert (out / "eval_accuracy.json").is_file()
    model = MTPModel.from_pretrained(out)
    assert model.config.head_accuracies is not None


def test_warm_start_continues_from_trained_heads(tmp_path, tiny_ckpt):  # noqa: F811
    """heads.init_from: the second stage starts with the first stage's heads, not fresh ones."""
    first = tmp_path / "stage1"
    train(make_config(tiny_ckpt, first, "train.max_steps=40"))
    second = tmp_path / "stage2"
    train(make_config(tiny_ckpt, second, f"heads.init_from={first}", "train.max_steps=1", "optim.lr=1e-9"))
    stage1 = json.loads((first / "eval_accuracy.json").read_text())["heads"]
    start = json.loads((second / "eval_untrained.json").read_text())["heads"]
    for a, b in zip(stage1, start, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-3)  # same heads, same held-out blocks
    fresh = json.loads((first / "eval_untrained.json").read_text())["heads"]
    assert start[0]["loss"] < fresh[0]["loss"] - 0.5


def test_warm_start_refuses_other_layouts_and_bases(tmp_path, tiny_ckpt):  # noqa: F811
    from mtp.train.config import ConfigError
    from mtp.train.tiny import make_tiny_checkpoint

    first = tmp_path / "stage1"
    train(make_config(tiny_ckpt, first, "train.max_steps=2", "train.eval_at_start=false"))
    with pytest.raises(ConfigError, match="heads.init_from.*do not match"):
        train(make_config(tiny_ckpt, tmp_path / "four", f"heads.init_from={first}", "heads.num_heads=4"))
    other = make_tiny_checkpoint(tmp_path / "other-llama", seed=1)
    with pytest.raises(ConfigError, match="different base model"):
        train(make_config(other, tmp_path / "other", f"heads.init_from={first}"))
    with pytest.raises(ConfigError, match="no directory"):
        train(make_config(tiny_ckpt, tmp_path / "none", f"heads.init_from={tmp_path / 'missing'}"))
