"""Checks of a whole sweep before its first job.

They catch what would otherwise show only after every job ran, such as a typo in
sweep.baseline; become a row per job, such as a value no key allows; or mix another sweep's
rows into this one's table, as a reused sweep dir would."""
from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

from ..record import columns


class SweepError(Exception):
    """A sweep check's failure, one line: `key: what`.

    The callback prints it and exits 2: Hydra would only warn about an exception a callback
    raises, and run the sweep."""


def check_sweep(config: DictConfig, params: dict) -> None:
    """Checks the sweep's settings, its dir, and its swept keys, values and baseline.

    params: each swept key, as written, -> its values."""
    from .. import validate
    from ..config import ConfigError

    try:  # sweep.* settings are the same for every job: wrong, they would fail each one
        validate.check_ranges(config, "sweep.")
    except ConfigError as e:
        raise SweepError(str(e)) from None
    check_dir(config)
    check_measured(params)
    check_values(params)
    check_baseline(config, params)


def check_search(config: DictConfig) -> None:
    """Checks a search's n_trials, and each value its space can give against the key alone.

    Each choice and each interval's two bounds must be of the key's type (an integer key's
    bounds integers) and in its declared range (Knob.check): a value that no trial could
    run with is refused, not tried n_trials times. A value wrong only with others, such as
    a seq_len over some model's max_seq_len, stays a failed trial, as in a grid."""
    from ..config import DEFAULTS, KNOBS
    from ..hydra_internals import search_space

    n = config.hydra.sweeper.get("n_trials")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise SweepError(f"hydra.sweeper.n_trials: must be a whole number >= 1, got {n}")
    try:
        space = search_space(config)
    except ValueError as e:
        raise SweepError(str(e)) from None
    except Exception:  # noqa: BLE001 - bad syntax: Hydra's own line, when the sweeper parses
        return
    for key, values in space.items():
        k = key.lstrip("+")
        if k not in KNOBS:
            continue
        default = DEFAULTS.get(k)
        for v in values:
            if isinstance(default, int) and not isinstance(default, bool) and \
                    (isinstance(v, bool) or not isinstance(v, int)):
                raise SweepError(f"{k}: the search's value {v} is not an integer (Hydra's "
                                 "interval(...) gives floats: int(interval(...)) integers)")
            if isinstance(default, float) and (isinstance(v, bool) or
                                               not isinstance(v, (int, float))):
                raise SweepError(f"{k}: the search's value {v} is not a number")
            for why in filter(None, (r.error(v) for r in KNOBS[k].check)):
                raise SweepError(f"{k}: {why} (the search's {k}={v})")


def check_jobs(config: DictConfig, jobs: list[list[str]], validate: bool = True) -> None:
    """Checks every job's configuration before any runs.

    - A job Hydra cannot compose, such as an option no group has: Hydra's own line.
    - Two jobs that would be one row: they differ only in keys their configuration does not
      read, which results.config_hash leaves out, such as comm.* on task=bench or a
      parallel=none run's rank settings. The second's record would be dropped from the table.
    - With `validate`, every job invalid or skipped, as with a `+` key no group has, a value
      every combination rejects, or precision=tf32,fp8 on a CPU: the first job's error. Jobs
      are validated in order until one can run, usually the first; invalid or skipped
      combinations among ones that run are rows (docs/sweeps.md: Nothing lost). Off for
      launchers whose jobs resolve their hardware where they run.
    - A key that only one option of its group reads, such as data.path or Muon's keys,
      where no job picks that option (validate.check_unread).

    Composing every job in full would be slow: the jobs validated are composed as the
    launcher will, the rest from one composition per choice of groups plus their value
    overrides (_Jobs.fast). A pair found that way is confirmed by composing both in full."""
    from ..pipeline import prepare
    from ..validate import unread_keys

    js = _Jobs(config)
    seen: dict[tuple, int] = {}
    first, statuses = None, set()
    base = _Baseline(config)
    unread = None  # keys no job so far reads: key -> (what picks, the option that reads it)
    for num, overrides in enumerate(jobs):
        try:
            if validate or num == 0:
                cfg = js.full(overrides)
                if validate:
                    _, rec = prepare(cfg, [o for o in overrides if not o.startswith("hydra.")],
                                     in_sweep=True)
                    validate = rec is not None and rec["status"] in ("invalid", "skipped")
                    if validate:
                        first = first or rec["error"]
                        statuses.add(rec["status"])
            else:
                cfg = js.fast(overrides)
            key = js.row(cfg)
            base.add(cfg, overrides)
            here = {k: v[:2] for k, v in unread_keys(cfg, overrides).items()}
            unread = here if unread is None else {k: v for k, v in unread.items() if k in here}
            same = key in seen and js.row(js.full(jobs[seen[key]])) == js.row(
                js.full(overrides))
        except SweepError:
            raise
        except Exception:  # noqa: BLE001 - the job reports it, as it would have (an error
            return  # escaping the callback would skip the rest of the sweep's start)
        if same:
            other = jobs[seen[key]]
            if sorted(overrides) == sorted(other):  # a value listed twice (precision=fp32,fp32)
                raise SweepError(f"{_listed_twice(config) or ' '.join(overrides)}: job #{num} "
                                 f"is job #{seen[key]} again: give each value once "
                                 "(sweep.repeats=N runs every job N times)")
            mine = " ".join(o for o in overrides if o not in other)
            theirs = " ".join(o for o in other if o not in overrides)
            raise SweepError(f"{mine}: job #{num} would measure what job #{seen[key]} "
                             f"({theirs}) does, one row: its configuration does not read "
                             "that setting (docs/record.md: config_hash); give it one value, or "
                             "tell the rows apart with +extra.NAME=...")
        seen.setdefault(key, num)
    if validate and first:
        what = "skipped on this machine" if statuses == {"skipped"} else \
            "invalid" if statuses == {"invalid"} else "invalid or skipped on this machine"
        raise SweepError(f"{first} (every job of the sweep is {what})")
    base.check()
    if unread:
        k, (picks, option) = next(iter(unread.items()))
        fix = f"use {option}" if picks[0] == "logger" else \
            f"add it to the sweep's {picks[0]} options"  # (logger is not swept: check_measured)
        raise SweepError(f"{k}: read by {option} only, and no job of this sweep has "
                         f"{option}: {fix}, or leave {k} out")


def _listed_twice(config) -> str | None:
    """'KEY=VALUE listed twice' for the first swept value given twice, if any."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(list(config.hydra.overrides.task))
    except Exception:  # noqa: BLE001 - only for the message
        return None
    for o in parsed:
        if o.is_sweep_override():
            values = list(o.sweep_string_iterator())
            if twice := next((v for i, v in enumerate(values) if v in values[:i]), None):
                return f"{o.get_key_element()}={twice} listed twice"
    return None


class _Baseline:
    """Checks that some job's row can match sweep.baseline, by the columns a job's config fixes.

    check_baseline checks the swept keys; this checks the rest, keys the sweep fixes
    elsewhere."""
    # the knobs' record columns, filled from the config, but those a run resolves
    # (hardware=auto) or its launch decides (the world size)
    FIXED = set(columns()) - {"hardware", "world_size"}

    def __init__(self, config: DictConfig) -> None:
        from ..results import EXTRAS, FIELDS
        from .live import baseline_of
        from .table import ADDED, norm_key

        # (a resumed dir's table also has the rows of earlier values: not checked)
        self.want = {} if config.sweep.resume else (baseline_of(config.sweep) or {})
        other = {*FIELDS, *EXTRAS, *ADDED} - self.FIXED  # known only once a job runs
        if any(norm_key(k) in other or norm_key(k).startswith("busbw_gbps_") or
               norm_key(k).endswith(("_min", "_max")) for k in self.want):
            self.want = {}
        self.seen: dict[str, set[str]] = {k: set() for k in self.want}
        self.matched = not self.want

    def add(self, cfg: DictConfig, overrides) -> None:
        if self.matched:
            return
        from ..results import new_record
        from ..pipeline import container
        from .table import row_value, same_value

        try:
            row = new_record(container(cfg), list(overrides))
            got = {k: row_value(row, k, "sweep.baseline") for k in self.want}
        except Exception:  # noqa: BLE001 - not known before the job runs: not checked
            self.matched = True
            return
        for k, v in got.items():
            self.seen[k].add(str(v))
        self.matched = all(same_value(v, self.want[k]) for k, v in got.items())

    def check(self) -> None:
        if self.matched:
            return
        from .table import MISSING, baseline_text

        have = "; ".join(f"{k}: {', '.join(sorted(v - {str(MISSING)})) or 'unset'}"
                         for k, v in self.seen.items())
        raise SweepError(f"sweep.baseline: no job of this sweep has {baseline_text(self.want)} "
                         f"(its jobs have {have}): no row could be the baseline")


class _Jobs:
    """Sweep jobs' configurations, less Hydra's own node, and their row keys."""

    def __init__(self, config: DictConfig) -> None:
        from hydra.core.global_hydra import GlobalHydra
        from hydra.core.override_parser.overrides_parser import OverridesParser

        self.config = config
        self.loader = GlobalHydra.instance().hydra.config_loader  # as the launcher's
        self.parser = OverridesParser.create(config_loader=self.loader)
        self.bases: dict[tuple, DictConfig] = {}
        self.groups: set[str] = set()  # config groups chosen in the jobs composed in full

    def full(self, overrides) -> DictConfig:
        """The job's config, composed as the launcher composes it.

        Hydra composes every job before the first runs, so an error here would end the sweep
        there too."""
        try:
            cfg = self.loader.load_sweep_config(self.config, list(overrides))
        except Exception as e:  # noqa: BLE001 - e.g. an option no group has
            from ..hydra_internals import hydra_error_line

            raise SweepError(hydra_error_line(e)) from None
        self.groups |= set(cfg.hydra.runtime.choices.keys())
        with open_dict(cfg):
            del cfg["hydra"]
        return cfg

    def fast(self, overrides) -> DictConfig:
        """The job's config from one composition of its group choices, its value overrides set.

        The groups known are those of the jobs composed in full before, the first job among
        them."""
        parsed = self.parser.parse_overrides(list(overrides))
        values = [o for o in parsed if not self._group(o.key_or_group)]
        if any(o.is_delete() for o in values):
            return self.full(overrides)
        groups = tuple(o.input_line for o in parsed if self._group(o.key_or_group))
        if groups not in self.bases:
            try:
                self.bases[groups] = self.full(groups)
            except SweepError:  # (the choices alone do not compose: only the job's say)
                return self.full(overrides)
        cfg = self.bases[groups].copy()
        OmegaConf.set_struct(cfg, False)
        try:
            for o in values:
                OmegaConf.update(cfg, o.key_or_group, o.value(), merge=False, force_add=True)
        except Exception:  # noqa: BLE001 - e.g. train.steps=a: Hydra's own line, as the
            return self.full(overrides)  # launcher would fail, before any job
        return cfg

    def _group(self, key: str) -> bool:
        return key in self.groups or key.split("/")[0] == "hydra" or key.startswith("hydra.")

    @staticmethod
    def row(cfg: DictConfig) -> tuple:
        from ..results import row_key
        from ..pipeline import container
        from .job import key_record

        return row_key(key_record(container(cfg)))


def _recorded_jobs(d: Path) -> int:
    """The number of jobs with a record: a job's, or a repeat's where a job was cut short."""
    from .table import job_dirs

    return len({*job_dirs(d), *(p.parent.parent for p in d.glob("*/rep*/metrics.json"))})


def resume_warning(config: DictConfig) -> str | None:
    """A warning for sweep.resume, set on the command line, on a dir with no records, said
    once the dir is this sweep's.

    It may be a typo, or a requeued job's first start, which is why the sweep still runs."""
    from ..config import override_texts

    d = Path(config.hydra.sweep.dir)
    asked = any(o.lstrip("+").startswith("sweep.resume=")  # (not a preset's: +sweep=search
                for o in override_texts(config.hydra.overrides.task))  # sets it itself)
    if config.sweep.resume and asked and not _recorded_jobs(d):
        return (f"[sweep] warning: sweep.resume=true, but '{d}' holds no job records: nothing "
                "to resume, every job runs")
    return None


def check_dir(config: DictConfig) -> None:
    if config.sweep.resume:
        return
    d = Path(config.hydra.sweep.dir)
    if n := _recorded_jobs(d):
        raise SweepError(f"hydra.sweep.dir: '{d}' already holds another sweep's results ({n} "
                         "job records): use a new dir, or sweep.resume=true to continue that "
                         "sweep")


def claim_dir(d: Path):
    """Lock the sweep dir for this sweep's life; the returned file holds the lock.

    A second sweep into it, such as a resume started twice or two sweeps given one dir,
    would write the same job dirs. On a filesystem without locks the dir is unguarded."""
    import fcntl
    import os
    import socket

    try:
        d.mkdir(parents=True, exist_ok=True)
        f = open(d / ".sweep.lock", "a+")
    except OSError as e:  # a file there, no permission
        raise SweepError(f"hydra.sweep.dir: cannot make '{d}' the sweep's dir: "
                         f"{e.strerror or e}") from None
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.fstat(f.fileno()).st_ino != os.stat(d / ".sweep.lock").st_ino:
            raise FileNotFoundError  # a sweep that just ended removed it (callback.release)
    except FileNotFoundError:  # (its lock would guard nothing): lock the new one
        f.close()
        return claim_dir(d)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise SweepError(f"hydra.sweep.dir: '{d}' is in use by another sweep ({holder}): wait "
                         "for it to end, or use a new dir") from None
    except OSError:
        return f
    f.truncate(0)
    f.write(f"pid {os.getpid()} on {socket.gethostname()}")
    f.flush()
    return f


def check_measured(params: dict) -> None:
    """Checks that each swept key changes what is measured or labels it, as `extra.*` does.

    sweep.* and logger settings are left out of the config hash, so their values would give
    one row. check_jobs checks the keys a configuration does not read."""
    for key, values in params.items():
        k = key.lstrip("+")
        if k.split(".")[0] in ("sweep", "logger") and len(values) > 1:
            raise SweepError(f"{k}: a setting of the sweep or its logging, not of what a job "
                             f"measures: give it one value (got {', '.join(values)})")


def _group_options(group: str) -> list[str]:
    """A config group's options as Hydra finds them, --config-dir included; [] for no group.

    A group that only hydra.searchpath adds gives [] too: its options are checked when the
    jobs are composed."""
    from hydra.core.global_hydra import GlobalHydra

    from ..config import CONF, group_options

    if GlobalHydra.instance().is_initialized():
        return GlobalHydra.instance().hydra.config_loader.get_group_options(group)
    return group_options(group) if (CONF / group).is_dir() else []


def check_values(params: dict) -> None:
    """Checks the swept values of config groups and of keys with fixed options, config.CHOICES.

    Hydra would say so only after writing multirun.yaml."""
    from ..config import CHOICES
    from ..validate import not_one_of

    for key, values in params.items():
        k = key.lstrip("+~")
        allowed = CHOICES.get(k) or _group_options(k)
        bad = [v for v in map(_unquoted, values) if allowed and str(v) not in allowed]
        if bad:
            raise SweepError(f"{k}: {not_one_of(bad[0], allowed)}")


def _unquoted(v: str) -> str:
    """'"off"' -> 'off': what a job gets for a quoted sweep value."""
    return v[1:-1] if len(v) >= 2 and v[0] == v[-1] and v[0] in "'\"" else v


def check_baseline(config: DictConfig, params: dict) -> None:
    """Checks that sweep.baseline and baseline_by name columns or keys this sweep sets.

    A key is a record column: results FIELDS or EXTRAS, a key of its `extra` dict, task=comm's
    busbw_gbps_<op>, or a repeat's *_min or *_max; or a key this sweep sets on the command
    line or in a preset. A baseline value must be one that some job has."""
    from ..config import override_texts
    from ..results import EXTRAS, FIELDS
    from .table import ADDED, norm_key, typed_value, same_value

    columns = {*FIELDS, *EXTRAS, *ADDED}
    overridden = {norm_key(k) for k in [*params, *(o.split("=", 1)[0] for o in override_texts(
        config.hydra.overrides.task) if "=" in o)]}
    baseline = OmegaConf.to_container(config.sweep.baseline) if config.sweep.baseline else {}
    extras = None
    for what, keys in (("sweep.baseline", list(baseline)),
                       ("sweep.baseline_by", list(config.sweep.baseline_by))):
        for key in keys:
            k = norm_key(key)
            if k.startswith("extra.") and k not in overridden:
                extras = extras if extras is not None else _extra_labels(config, params)
                if extras is not _UNKNOWN and k not in extras:
                    raise SweepError(f"{what}: '{key}' is a label no job of this sweep has "
                                     f"(its labels: {', '.join(sorted(extras)) or 'none'})")
            elif k not in columns and k not in overridden and \
                    not k.startswith("busbw_gbps_") and not k.endswith(("_min", "_max")):
                raise SweepError(f"{what}: '{key}' is not a column of the table (e.g. precision, "
                                 "compile, optim, model, extra.seed_row) nor a key this sweep "
                                 "sets")
    # swept values as written: '1e-3' quoted is the string a job's table row compares
    swept = {norm_key(k): v for k, v in params.items()}
    # a swept key: a row per value (a resumed dir's table also has earlier values' rows)
    for key, want in ({} if config.sweep.get("resume") else baseline).items():
        values = swept.get(norm_key(key))
        if values and not any(same_value(typed_value(v), want) for v in values):
            raise SweepError(f"sweep.baseline: {key}={want} is not among the swept values "
                             f"({', '.join(values)}): no row could be the baseline")
        labels = None if values or not isinstance(extras, dict) else extras.get(norm_key(key))
        # a label the swept options set (seed_row)
        if labels and not any(same_value(v, want) for v in labels):
            raise SweepError(f"sweep.baseline: {key}={want} is not a value any job has "
                             f"({', '.join(sorted(labels))}): no row could be the baseline")


def _extra_labels(config: DictConfig, params: dict):
    """The labels a job of this sweep can have: {extra.KEY: the values it can have}.

    They are the composed config's, from run.yaml, presets and the command line, and those
    the options of a swept group set, such as seed_row. _UNKNOWN where an option is not
    moe_exp's own file."""
    from ..config import CONF

    labels: dict[str, set[str]] = {}

    def add(extra) -> None:
        for k, v in (extra or {}).items():
            labels.setdefault(f"extra.{k}", set()).add(str(v))

    add(config.get("extra"))
    for key, values in params.items():
        group = key.lstrip("+~")
        for v in values if _group_options(group) else []:
            f = CONF / group / f"{_unquoted(v)}.yaml"
            if not f.is_file():  # (an option from --config-dir: its labels are not known here)
                return _UNKNOWN
            if "@package _global_" in f.read_text():
                add(OmegaConf.load(f).get("extra"))
    return labels


_UNKNOWN = object()  # labels a sweep's options set that this check cannot read
