"""Launchable training script: the same code path as `mtp train`, for launchers that start a file.

    python train/run.py --config configs/medusa1-frozen.yaml
    torchrun --nproc_per_node 2 train/run.py --config configs/medusa1-frozen.yaml
    deepspeed --num_gpus 2 train/run.py --config configs/medusa1-frozen.yaml --override deepspeed=configs/ds_zero2.json

(`python -m mtp.train.run ...` and `torchrun -m mtp.train.run ...` work too.) The deepspeed launcher
appends `--local_rank=N`; it is accepted and ignored, since LOCAL_RANK is in the environment as well.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Started as a file, Python puts this directory first on sys.path, where config.py / data.py would
# shadow any top-level modules of the same name. The package is imported as `mtp.train` instead.
_HERE = str(Path(__file__).resolve().parent)
sys.path[:] = [p for p in sys.path if str(Path(p or ".").resolve()) != _HERE]


def parse_args(argv: list[str] | None = None):
    import argparse

    parser = argparse.ArgumentParser(description="Train Medusa-1/2 heads (see configs/ for examples).")
    parser.add_argument("--config", required=True, help="YAML training config")
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                        help="set a config key, e.g. optim.lr=3e-4 (repeatable)")  # fmt: skip
    parser.add_argument("--resume", choices=["auto", "always", "never"], default=None,
                        help="override train.resume")  # fmt: skip
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from mtp.train.cli import run_training

    args = parse_args(argv)
    return run_training(args.config, args.override, args.resume)


if __name__ == "__main__":
    sys.exit(main())
