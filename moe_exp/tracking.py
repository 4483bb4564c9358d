"""Weights & Biases logging: offline by default, always finished, even when the run fails."""
from __future__ import annotations

import os
import time
from pathlib import Path

from .config import ConfigError, NotReady, env_source


def wandb_settings():
    import wandb

    return wandb.Settings(silent=True, x_disable_stats=True, x_disable_machine_info=True,
                          disable_git=True, save_code=False)


class Tracker:
    """One W&B run; with defer=True, started only at finish() and its logging replayed.

    Deferred, W&B's start-up, its imports and service process, is neither in the time to
    the first measured step nor competing for the CPU during the measured steps. Replayed
    history rows keep the wall time of their log() call as W&B's `_timestamp`, its "Wall
    Time" axis; W&B computes `_runtime` from its own start, so "Relative Time" is the
    replay's."""

    def __init__(self, logger, config: dict, out_dir: Path, tags: list[str], name: str | None,
                 defer: bool = False):
        """logger: the run's logger group; config: the run's config, W&B's copy of it."""
        self.run = None
        self._pending: list | None = None
        if logger.name != "wandb" or logger.mode == "disabled":
            return
        self._kwargs = dict(
            project=logger.project, entity=logger.entity, group=logger.group, mode=logger.mode,
            dir=str(out_dir), config=config, name=name, job_type="bench",
            tags=sorted(set(tags) | set(logger.tags)))
        if defer:
            self._pending = []
        else:
            self._start()

    def _start(self) -> None:
        import wandb

        self.run = wandb.init(**self._kwargs, settings=wandb_settings())

    def log(self, metrics: dict, step: int) -> None:
        if self._pending is not None:
            self._pending.append(("log", {**metrics, "_timestamp": time.time()}, step))
        elif self.run:
            self.run.log(metrics, step=step)

    def table(self, key: str, df) -> None:
        """A pandas DataFrame as a W&B Table."""
        if self._pending is not None:
            self._pending.append(("table", (key, df), None))
        elif self.run:
            import wandb

            self.run.log({key: wandb.Table(dataframe=df)})

    def summary(self, record: dict) -> None:
        """The whole record as the run's summary, nulls, reasons and per-expert counts too.

        The loss curve is left out: it is the history."""
        flat = {k: v for k, v in record.items() if k != "losses"}
        if self._pending is not None:
            self._pending.append(("summary", flat, None))
        elif self.run:
            self.run.summary.update(flat)

    def discard(self) -> None:
        """Drops a deferred W&B run that never started, as on an interrupt; a started one ends."""
        self._pending = None
        if self.run:
            self.run.finish(exit_code=1)
            self.run = None

    def finish(self, ok: bool) -> None:
        """Starts a deferred run and replays its logging, then finishes the W&B run.

        A failure of W&B's is a warning: the run's record is written already."""
        try:
            if self._pending is not None:
                pending, self._pending = self._pending, None
                self._start()
                for kind, data, step in pending:
                    if kind == "log":
                        self.log(data, step)
                    elif kind == "table":
                        self.table(*data)
                    else:
                        self.run.summary.update(data)
            if self.run:
                self.run.finish(exit_code=0 if ok else 1)
        except Exception as e:  # noqa: BLE001
            import sys

            line = (str(e).strip().splitlines() or [""])[0][:300]
            print(f"warning: W&B logging failed: {type(e).__name__}: {line}", file=sys.stderr)
        self.run = None


# W&B's rules, checked before any work (validate.validate)

def wandb_credentials() -> bool:
    """Whether W&B will find credentials here.

    WANDB_API_KEY or WANDB_IDENTITY_TOKEN_FILE, else a .netrc key for its server or the
    server's aliases. The server is WANDB_BASE_URL, else the one `wandb login --host` saved,
    else W&B's default. The .netrc is read with W&B's own reader where this W&B has it,
    which starts no service process and uses no network; else by hand."""
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
    """Checks that W&B takes the project name and tags; else its init fails after the run."""
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
    """Checks that logger.mode=online has W&B credentials, now rather than at the run's end.

    Raises NotReady, status error: a resumed sweep runs it again once logged in."""
    lg = cfg.logger
    if lg.name == "wandb" and lg.mode == "online" and not wandb_credentials():
        raise NotReady(env_source(cfg, "logger.mode") or "logger.mode", "online needs W&B "
                       "credentials and none were found: run `wandb login` or set "
                       "WANDB_API_KEY, or use logger.mode=offline")
