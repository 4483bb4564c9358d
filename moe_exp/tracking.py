"""Weights & Biases logging: offline by default, always finished, even when the run fails."""
from __future__ import annotations

import time
from pathlib import Path


def _settings():
    import wandb

    return wandb.Settings(silent=True, x_disable_stats=True, x_disable_machine_info=True,
                          disable_git=True, save_code=False)


class Tracker:
    """One W&B run. defer=True starts W&B only at finish(): the logged history and the
    summary are replayed then, so W&B's start-up (about 2 s on a 2-core machine: imports and
    its service process) is neither in the time to the first measured step nor, with its
    service process, competing for the CPU during the measured steps. Replayed history rows
    keep the wall time of their log() call (W&B's `_timestamp`: its "Wall Time" axis); W&B
    computes `_runtime` from its own start, so "Relative Time" is the replay's."""

    def __init__(self, cfg, cfg_dict: dict, out_dir: Path, tags: list[str], name: str | None,
                 defer: bool = False):
        self.run = None
        self._pending: list | None = None
        if cfg.logger.name != "wandb" or cfg.logger.mode == "disabled":
            return
        self._kwargs = dict(
            project=cfg.logger.project, entity=cfg.logger.entity, group=cfg.logger.group,
            mode=cfg.logger.mode, dir=str(out_dir), config=cfg_dict, name=name, job_type="bench",
            tags=sorted(set(tags) | set(cfg.logger.tags)))
        if defer:
            self._pending = []
        else:
            self._start()

    def _start(self) -> None:
        import wandb

        self.run = wandb.init(**self._kwargs, settings=_settings())

    def log(self, metrics: dict, step: int) -> None:
        if self._pending is not None:
            self._pending.append(("log", {**metrics, "_timestamp": time.time()}, step))
        elif self.run:
            self.run.log(metrics, step=step)

    def summary(self, record: dict) -> None:
        """The whole record (nulls, their reasons and the per-expert counts too); the loss
        curve is the history."""
        flat = {k: v for k, v in record.items() if k != "losses"}
        if self._pending is not None:
            self._pending.append(("summary", flat, None))
        elif self.run:
            self.run.summary.update(flat)

    def discard(self) -> None:
        """A deferred run that never starts (the run was interrupted); a started one ends."""
        self._pending = None
        if self.run:
            self.run.finish(exit_code=1)
            self.run = None

    def finish(self, ok: bool) -> None:
        """A failure of W&B's is a warning: the run's record is written already."""
        try:
            if self._pending is not None:
                pending, self._pending = self._pending, None
                self._start()
                for kind, data, step in pending:
                    self.log(data, step) if kind == "log" else self.run.summary.update(data)
            if self.run:
                self.run.finish(exit_code=0 if ok else 1)
        except Exception as e:  # noqa: BLE001
            import sys

            line = (str(e).strip().splitlines() or [""])[0][:300]
            print(f"warning: W&B logging failed: {type(e).__name__}: {line}", file=sys.stderr)
        self.run = None


def read_offline_run(run_file: str | Path) -> dict:
    """Parse an offline `run-*.wandb` file (a 7-byte W&B header, then a LevelDB-log stream of
    protobuf Records) into {config, summary, history, exit_code, group, start_time (epoch s)}.
    For tests and reports."""
    import json

    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(run_file).read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{run_file} is not a W&B run file")
    block, pos, buf, payloads = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # block trailer padding
            pos += block - pos % block
            continue
        length = int.from_bytes(data[pos + 4: pos + 6], "little")
        kind = data[pos + 6]
        chunk = data[pos + 7: pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        buf = chunk if kind in (1, 2) else buf + chunk  # FULL/FIRST start, MIDDLE/LAST append
        if kind in (1, 4):
            payloads.append(buf)
    out = {"config": {}, "summary": {}, "history": [], "exit_code": None, "group": None,
           "start_time": None}
    for payload in payloads:
        rec = pb.Record()
        rec.ParseFromString(payload)
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            out["group"] = rec.run.run_group or out["group"]
            if rec.run.HasField("start_time"):
                out["start_time"] = rec.run.start_time.ToMicroseconds() / 1e6
        if kind in ("config", "run"):
            items = rec.config.update if kind == "config" else rec.run.config.update
            for item in items:
                out["config"][item.key] = json.loads(item.value_json)
        elif kind == "summary":
            for item in rec.summary.update:
                out["summary"][item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
        elif kind == "history":
            out["history"].append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json)
                                   for i in rec.history.item})
        elif kind == "exit":
            out["exit_code"] = rec.exit.exit_code
    return out


def log_sweep(df, sweep_dir: Path, logger_cfg, group: str, pngs: dict) -> None:
    """One summary run for a sweep: the results table, bar charts and the PNG plots."""
    import wandb

    from .sweep.plots import ok_rows
    from .sweep.table import flat

    run = wandb.init(project=logger_cfg.project, entity=logger_cfg.entity, group=group,
                     mode=logger_cfg.mode, dir=str(sweep_dir), name=f"{group}-summary",
                     job_type="sweep-summary", config={"sweep_dir": str(sweep_dir)},
                     settings=_settings())
    try:
        f = flat(df)
        f = f.astype(object).where(f.notna(), None)
        ok = ok_rows(df)
        charts = {}
        for key, col, title in (("throughput", "tokens_per_s", "tokens/s by combination"),
                                ("peak_memory", "peak_mem_gib", "peak memory (GiB)")):
            d = ok[ok[col].notna()]
            t = wandb.Table(columns=["combination", col],
                            data=[[n, float(v)] for n, v in zip(d["name"], d[col])])
            charts[key] = wandb.plot.bar(t, "combination", col, title=title)
        images = {f"plot/{k}": wandb.Image(str(p)) for k, p in pngs.items()}
        run.log({"results": wandb.Table(dataframe=f, allow_mixed_types=True), **charts, **images})
        best = ok.loc[ok["tokens_per_s"].idxmax()] if len(ok) else None
        run.summary.update({"jobs": len(df), "jobs_ok": int((df["status"] == "ok").sum()),
                            **({"best_combination": best["name"],
                                "best_tokens_per_s": float(best["tokens_per_s"])}
                               if best is not None else {})})
    finally:
        run.finish()
