"""Weights & Biases logging: offline by default, always finished, even when the run fails."""
from __future__ import annotations

import os
import time
from pathlib import Path

from .config import ConfigError, NotReady, env_source


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


# W&B's rules, checked before any work (validate.validate)

def wandb_credentials() -> bool:
    """Whether W&B will find credentials here: WANDB_API_KEY or WANDB_IDENTITY_TOKEN_FILE,
    else a .netrc key for its server (WANDB_BASE_URL, the one `wandb login --host` saved, or
    W&B's default) or the server's aliases. Read with W&B's own .netrc reader where this
    W&B has it (no service process, no network), else by hand."""
    import configparser
    from urllib.parse import urlsplit

    env = os.environ
    if env.get("WANDB_API_KEY") or env.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    base = env.get("WANDB_BASE_URL")
    if not base:
        settings = configparser.ConfigParser()  # `wandb login --host` records its server
        try:
            settings.read(Path(env.get("WANDB_CONFIG_DIR") or "~/.config/wandb").expanduser()
                          / "settings")
            base = settings.get("default", "base_url", fallback=None)
        except (OSError, ValueError, configparser.Error):  # unreadable: the default server
            pass
    try:
        from wandb.sdk.lib import urls
        from wandb.sdk.lib.wbauth import wbnetrc

        reader = wbnetrc.read_netrc_auth
        base = base or urls.DEFAULT_BASE_URL
    except (ImportError, AttributeError):  # another W&B: the same rules by hand
        hosts = {urlsplit(base).netloc} if base else {"api.wandb.ai", "api.forge.coreweave.com"}
        return _netrc_has_key(hosts)
    try:
        return bool(reader(host=base))
    except Exception:  # noqa: BLE001 - a malformed key: W&B would refuse it too
        return False


def _netrc_has_key(hosts) -> bool:
    import netrc

    env = os.environ
    paths = [Path(env["NETRC"]).expanduser()] if env.get("NETRC") else \
        [Path("~/.netrc").expanduser(), Path("~/_netrc").expanduser()]
    for path in paths:
        try:
            found = netrc.netrc(path)
        except (OSError, netrc.NetrcParseError):
            continue
        return any((found.authenticators(h) or (None, None, ""))[2] for h in hosts)
    return False


WANDB_PROJECT_BAD = "/\\#?%:"


def check_logger(cfg) -> None:
    """A W&B project name and tags W&B takes (its init would fail after the run)."""
    lg = cfg.logger
    if lg.name != "wandb" or lg.mode == "disabled":
        return
    bad = [c for c in WANDB_PROJECT_BAD if c in lg.project]  # (W&B's own rules: its init
    if bad or not 1 <= len(lg.project) <= 128:  # would fail after the run)
        raise ConfigError("logger.project", f"'{lg.project}': a W&B project name is 1 to 128 "
                          f"characters, none of {' '.join(WANDB_PROJECT_BAD)}")
    for tag in lg.tags:
        if not isinstance(tag, str) or not 1 <= len(tag) <= 64:
            raise ConfigError("logger.tags", f"{tag!r}: a W&B tag is a string of 1 to 64 "
                              "characters")


def logger_ready(cfg) -> None:
    """logger.mode=online needs W&B credentials: checked now, not when the run is logged
    at its end. A NotReady (status error): a resumed sweep runs it again once logged in."""
    lg = cfg.logger
    if lg.name == "wandb" and lg.mode == "online" and not wandb_credentials():
        raise NotReady(env_source(cfg, "logger.mode") or "logger.mode", "online needs W&B "
                       "credentials and none were found: run `wandb login` or set "
                       "WANDB_API_KEY, or use logger.mode=offline")
