"""Shared helpers for the training tests (no tests here): a tiny byte-level checkpoint, stdlib text, configs."""

from __future__ import annotations

import json
import socket
import sysconfig
from pathlib import Path
from typing import Any

import pytest
import torch

from mtp.train.config import Config, apply_overrides, config_from_dict
from mtp.train.tiny import make_tiny_checkpoint

STDLIB = Path(sysconfig.get_paths()["stdlib"])
# A few plain-Python modules that exist on every CPython >= 3.10: real code text, ~100 KB.
STDLIB_MODULES = ["textwrap.py", "string.py", "shlex.py", "heapq.py", "calendar.py"]
REPO = Path(__file__).resolve().parents[1]


def stdlib_files(names: list[str] | None = None) -> list[str]:
    files = [STDLIB / n for n in (names or STDLIB_MODULES)]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        pytest.skip(f"stdlib sources not installed: {missing}")
    return [str(f) for f in files]


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    """A random 2-layer Llama (vocab 264) with a byte-level tokenizer and a chat template."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny-llama")


def sharpened_copy(model: Path, dest: Path) -> Path:
    """A copy of a tiny checkpoint with its final norm scaled x16: a random model's next-token distribution is
    nearly uniform (nothing for heads to learn); scaled, it is as peaked as a trained model's."""
    import shutil

    from transformers import AutoModelForCausalLM

    shutil.copytree(model, dest)
    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    with torch.no_grad():
        m.model.norm.weight.mul_(16.0)
    m.save_pretrained(dest)
    return dest


def base_config(model: Path, output_dir: Path, data: Any = None) -> dict[str, Any]:
    return {
        "model": {"path": str(model)},
        "heads": {"num_heads": 3},
        "data": {"path": data if data is not None else stdlib_files(), "block_size": 64, "eval_fraction": 0.1},
        "optim": {"lr": 1e-2, "warmup_steps": 2},
        "train": {
            "output_dir": str(output_dir),
            "micro_batch_size": 4,
            "max_steps": 10,
            "log_every": 1,
            "progress": False,
            "num_threads": 1,
        },
    }


def make_config(model: Path, output_dir: Path, *overrides: str, data: Any = None) -> Config:
    return config_from_dict(apply_overrides(base_config(model, output_dir, data), list(overrides)))


def write_config(path: Path, model: Path, output_dir: Path, *overrides: str, data: Any = None) -> Path:
    import yaml

    raw = apply_overrides(base_config(model, output_dir, data), list(overrides))
    path.write_text(yaml.safe_dump(raw))
    return path


def read_metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines() if line]


def load_heads(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state = load_file(str(path))
    state.pop("base_probe", None)
    return state


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_heap_trimmer_gives_pages_back_past_its_slack():
    """After a burst of odd-sized frees, trimming hands memory back (what keeps the SmolLM2 run under 4 GB)."""
    import sys

    from mtp.train import trainer

    if not sys.platform.startswith("linux"):
        pytest.skip("glibc malloc_trim is Linux-only")
    assert trainer._TRIM is not None
    trim = trainer.HeapTrimmer(slack_mb=200)
    assert trim() and not trim()  # the first call sets the floor; nothing has grown since

    # Freeing a 16 MB mmapped block makes glibc raise its mmap threshold to 16 MB (its dynamic rule), so the
    # odd-sized blocks after it come from the heap, as a training step's do; one block stays alive above them.
    big = torch.empty(4 * 1024 * 1024)
    big.fill_(1.0)
    del big
    blocks = [torch.empty(2000 + 37 * i, 64) for i in range(300)]  # 0.5-3.3 MB each, ~530 MB in all
    keep = torch.empty(1000, 64)
    for b in blocks:
        b.fill_(1.0)
    del blocks
    before = trainer._rss_kb()
    assert trim() and trim.trims == 2  # grown by > 200 MB since the last trim
    after = trainer._rss_kb()
    assert keep.numel() and after < before - 300_000  # most of the freed ~530 MB went back to the OS
