"""Where training numbers go: a progress bar, `metrics.jsonl` next to the checkpoints, and optionally wandb.

`metrics.jsonl` is always written (rank 0) because it is the one record that needs no service: tests read
the loss curve from it, and after a resume it is cut back to the resumed step so the file shows one
continuous curve. wandb is opt-in (`tracking.report_to: wandb`) and offline unless the user has set
WANDB_MODE; it is never needed to train or to run the tests.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any

from .config import Config, ConfigError
from .distributed import DistEnv


def require_wandb(cfg: Config) -> None:
    """Fail at start-up, not after model loading, when wandb is asked for but missing."""
    if cfg.tracking.report_to == "wandb":
        try:
            import wandb  # noqa: F401
        except ImportError as e:
            raise ConfigError("tracking.report_to is 'wandb' but wandb is not installed: pip install wandb") from e


class Tracker:
    def __init__(self, cfg: Config, env: DistEnv, output_dir: Path, start_step: int, total_steps: int):
        self.active = env.is_main
        self.path = output_dir / "metrics.jsonl"
        self.run = None
        self.bar = None
        if not self.active:
            return
        self._truncate(start_step)
        if cfg.tracking.report_to == "wandb":
            os.environ.setdefault("WANDB_MODE", "offline")
            os.environ.setdefault("WANDB_DIR", str(output_dir))
            import wandb

            id_file = output_dir / "wandb_run_id"
            # a stable id per output dir, so a resumed run continues the same wandb run
            run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(4)
            id_file.write_text(run_id)
            self.run = wandb.init(
                project=cfg.tracking.project, name=cfg.tracking.run_name, id=run_id, resume="allow",
                config=cfg.to_dict(),
            )  # fmt: skip
        if cfg.train.progress:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True)

    def _truncate(self, step: int) -> None:
        """Drop records past `step` (written by a run that was killed before its next checkpoint)."""
        if not self.path.is_file():
            return
        kept = [line for line in self.path.read_text().splitlines() if line and json.loads(line).get("step", 0) <= step]
        self.path.write_text("".join(line + "\n" for line in kept))

    def log(self, step: int, metrics: dict[str, Any], show: dict[str, str] | None = None) -> None:
        if not self.active:
            return
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        if self.run is not None:
            self.run.log({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, step=step)
        if self.bar is not None and show:
            self.bar.set_postfix(show, refresh=False)

    def advance(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def write(self, message: str) -> None:
        if not self.active:
            return
        if self.bar is not None:
            self.bar.write(message)
        else:
            print(message, flush=True)

    def summary(self, values: dict[str, Any]) -> None:
        if self.run is not None:
            self.run.summary.update(values)

    def close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def close(self) -> None:
        self.close_bar()
        if self.run is not None:
            self.run.finish()
