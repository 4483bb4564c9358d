"""Weights & Biases logging: offline by default, always finished, even when the run fails."""
from __future__ import annotations

from pathlib import Path


class Tracker:
    def __init__(self, cfg, cfg_dict: dict, out_dir: Path, tags: list[str], name: str | None):
        self.run = None
        if cfg.logger.name != "wandb" or cfg.logger.mode == "disabled":
            return
        import wandb

        self.run = wandb.init(
            project=cfg.logger.project, entity=cfg.logger.entity, group=cfg.logger.group,
            mode=cfg.logger.mode, dir=str(out_dir), config=cfg_dict, name=name, job_type="bench",
            tags=sorted(set(tags) | set(cfg.logger.tags)),
            settings=wandb.Settings(silent=True, x_disable_stats=True, x_disable_machine_info=True,
                                    disable_git=True, save_code=False),
        )

    def log(self, metrics: dict, step: int) -> None:
        if self.run:
            self.run.log(metrics, step=step)

    def summary(self, record: dict) -> None:
        if self.run:
            flat = {k: v for k, v in record.items() if isinstance(v, (int, float, str, bool))}
            self.run.summary.update(flat)

    def finish(self, ok: bool) -> None:
        if self.run:
            self.run.finish(exit_code=0 if ok else 1)
            self.run = None
