"""The entrypoint: compose -> validate -> build -> optimize -> bench -> record.

    python -m moe_exp.run [group=option ...] [key=value ...]
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from . import config as _config  # noqa: F401  (registers the schemas)
from . import help as _help  # noqa: F401  (--help's resolvers)
from .config import override_texts
from .config import ConfigError
from .ranks import rank_env
from .results import failed_record, new_record, stop_on_sigterm, stop_signal, write_json_atomic

EXIT_INVALID, EXIT_FAILED = 2, 1
_STARTED = False  # main() has been called: Hydra's own set-up (the output dir) is done


def _hydra_info() -> tuple[Path | None, list[str], dict, bool]:
    """(output dir, task overrides, group choices, is multirun) when run under Hydra."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return None, [], {}, False
    hc = HydraConfig.get()
    choices = {k: v for k, v in hc.runtime.choices.items() if not k.startswith("hydra")}
    return (Path(hc.runtime.output_dir), override_texts(hc.overrides.task), choices,
            hc.mode == RunMode.MULTIRUN)


def from_launch_dir(path: str) -> str:
    """A relative path from where the command was run: hydra.job.chdir=true moves the run into
    its output dir (unchanged otherwise, so the config hash is too)."""
    from hydra.core.hydra_config import HydraConfig

    if os.path.isabs(path) or not HydraConfig.initialized():
        return path
    start = HydraConfig.get().runtime.cwd
    return path if os.path.realpath(start) == os.getcwd() else os.path.join(start, path)


def prepare(cfg: DictConfig, overrides: list[str],
            in_sweep: bool = False) -> tuple[DictConfig, dict | None]:
    """Resolve the hardware and validate, before any work. Returns (cfg, None) when the run
    can go ahead, else (cfg, record) with status `invalid` (a mistake), `skipped` (a valid
    request this hardware cannot do) or `error` (this environment is not ready: NotReady).
    in_sweep: a sweep's job (validate.check_unread)."""
    from .config import NotReady, Unsupported
    from .hardware import resolve
    from .validate import check_complete, check_resolves, validate

    cfg = cfg.copy()
    OmegaConf.set_struct(cfg, False)
    try:
        check_resolves(cfg)
        check_complete(cfg)
        if not OmegaConf.is_missing(cfg.data, "path") and isinstance(cfg.data.path, str):
            cfg.data.path = from_launch_dir(os.path.expanduser(cfg.data.path))  # ~/corpus.bin
        resolve(cfg)
        validate(cfg, overrides, in_sweep)
    except ConfigError as e:
        status = "skipped" if isinstance(e, Unsupported) else \
            "error" if isinstance(e, NotReady) else "invalid"
        return cfg, failed_record(_container(cfg), overrides, status, str(e), f"not run: {status}")
    return cfg, None


def run(cfg: DictConfig, out_dir: Path | None = None, progress: bool = True,
        overrides: list[str] | None = None, choices: dict | None = None,
        shared_process: bool = False, in_sweep: bool = False) -> dict:
    """Run one benchmark; never raises for a run's failure: the record's status says it.
    shared_process: a later run of an in-process sweep (see bench.runner.shared_process).
    in_sweep: a sweep's job (validate.check_unread)."""
    hydra_dir, hydra_overrides, hydra_choices, _ = _hydra_info()
    overrides = hydra_overrides if overrides is None else overrides
    choices = hydra_choices if choices is None else choices
    out_dir = Path(out_dir or hydra_dir or "outputs/run")
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg, rec = prepare(cfg, overrides, in_sweep)
    if rec is not None:
        if (env := rank_env()) and env.rank != 0:  # torchrun's other ranks: rank 0 reports
            return rec
        write_json_atomic(out_dir / "metrics.json", rec)
        print(f"error: {rec['error']}", file=sys.stderr)
        log_record(rec)
        return rec

    from .hardware import hardware_env

    with hardware_env(cfg.hardware):
        try:
            rec = _run(cfg, out_dir, overrides, choices, progress, shared_process)
        except KeyboardInterrupt:  # Ctrl-C / SIGTERM: the record it wrote, into run.log too
            with contextlib.suppress(OSError, ValueError, KeyError):
                done = json.loads((out_dir / "metrics.json").read_text())
                if done["status"] == "crashed" and "interrupted" in (done["error"] or ""):
                    log_record(done)
            raise
    if rec is not None:
        log_record(rec)
    return rec


def log_record(rec: dict) -> None:
    """The record's gist into the run's log (Hydra's run.log; the terminal has the table)."""
    import logging

    log = logging.getLogger("moe_exp")
    log.info("overrides: %s", " ".join(rec.get("overrides") or []) or "(none)")
    log.info("status: %s%s", rec["status"], f": {rec['error']}" if rec.get("error") else "")
    if rec["status"] == "ok" and rec.get("tokens_per_s") is not None:  # a bench (not comm)
        from .summary import summary_rows

        for label, text in summary_rows(rec):
            log.info("%s: %s", label, text)


def distributed_run(cfg) -> bool:
    """Whether the run has ranks (launched here, or started by torchrun / SLURM)."""
    return cfg.parallel.name != "none" or cfg.hardware.devices > 1 or cfg.task == "comm"


def _run(cfg: DictConfig, out_dir: Path, overrides, choices, progress,
         shared_process: bool = False) -> dict | None:
    cfg_dict = _container(cfg)
    if distributed_run(cfg):
        from .distributed import is_rank

        if is_rank():  # started by torchrun / SLURM: this process is one of the ranks
            return rank_main(cfg_dict, str(out_dir), overrides, choices, progress)
        return launch(cfg_dict, out_dir, overrides, choices, progress)

    from .bench.runner import bench

    rec = new_record(cfg_dict, overrides)
    return bench(cfg, cfg_dict, rec, out_dir, choices, progress, shared=shared_process)


def launch(cfg_dict: dict, out_dir: Path, overrides, choices, progress) -> dict:
    """hardware.devices ranks on this machine via torch's elastic agent; rank 0's record.
    A rank that fails stops them all; the record names it (status error, oom, or crashed:
    killed by a signal)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from .bench.memory import oom_line, oom_text
    from .distributed import (failure_message, failure_report, killed_by_signal,
                              launch as elastic, rank_entry)

    try:
        rec = elastic(rank_entry, cfg_dict["hardware"]["devices"], rank_main, cfg_dict,
                      str(out_dir), overrides, choices, progress, True)
    except ChildFailedError as e:
        (out_dir / "error.log").write_text(failure_report(e))
        msg = failure_message(e)
        oom = oom_text(msg)
        msg = f"{oom_line(msg) if oom else msg} (see {out_dir}/error.log)"
        status = "oom" if oom else "crashed" if killed_by_signal(e) else "error"
        rec = failed_record(cfg_dict, overrides, status, msg, f"not measured: run {status}")
        if cfg_dict.get("task", "bench") == "bench":
            _known_before_the_run(rec, cfg_dict)
        write_json_atomic(out_dir / "metrics.json", rec)
        print(f"error: run {rec['status']}: {msg}\nrecord: {out_dir / 'metrics.json'}",
              file=sys.stderr)
    return rec


def _known_before_the_run(rec: dict, cfg_dict: dict) -> None:
    """What a failed launch's record still knows (analytic, or of this process): parameter
    counts, FLOPs per token, the torch version."""
    import torch

    from .bench.flops import analytic

    known = {**analytic(OmegaConf.create(cfg_dict["model"]), cfg_dict["train"]["seq_len"]),
             "torch_version": torch.__version__}
    rec.update(known)
    for k in known:
        rec["null_reasons"].pop(k, None)


def rank_main(cfg_dict: dict, out_dir: str, overrides, choices, progress,
              launched_here: bool = False) -> dict | None:
    """One rank: join the group, run the task, leave. Rank 0 returns the record.
    launched_here: by `launch` (which records a failure), not by torchrun / SLURM."""
    from . import distributed

    parent = os.getppid()  # (launched here: the process that runs launch)
    cfg = OmegaConf.create(cfg_dict)
    d = distributed.init(cfg)
    d.launched_here = launched_here
    try:
        rec = new_record(cfg_dict, overrides)
        if cfg.task == "comm":
            from .bench.comm import comm_bench

            rec = comm_bench(cfg, cfg_dict, rec, Path(out_dir), choices, d)
        else:
            from .bench.runner import bench

            rec = bench(cfg, cfg_dict, rec, Path(out_dir), choices, progress, d)
        return rec if d.main else None
    except BaseException as e:  # a SIGINT (Ctrl-C, or the launcher killed outright), or
        # what a collective raised when the other ranks stopped
        if launched_here and d.main:
            distributed.reword_for_vanished_launcher(Path(out_dir) / "metrics.json", parent,
                                                     distributed.vanish_wait(e))
        raise
    finally:
        distributed.finish()


def _container(cfg) -> dict:
    """The config as a dict, resolved; where a ${...} does not resolve, that value null."""
    try:
        return OmegaConf.to_container(cfg, resolve=True)
    except Exception:  # noqa: BLE001 - e.g. ${bogus}: keep what resolves
        return _resolved(cfg)


def _resolved(node):
    from omegaconf import DictConfig, ListConfig

    if isinstance(node, ListConfig):
        keys = range(len(node))
    elif isinstance(node, DictConfig):
        keys = list(node.keys())
    else:
        return node
    out = [None] * len(keys) if isinstance(node, ListConfig) else {}
    for k in keys:
        try:
            out[k] = _resolved(node[k])
        except Exception:  # noqa: BLE001 - this value does not resolve (or is missing)
            out[k] = None
    return out


@hydra.main(version_base="1.3", config_path="conf", config_name="run")
def main(cfg: DictConfig) -> dict:
    global _STARTED
    _STARTED = True
    if _hydra_info()[3]:  # a sweep job: in its own process, never raises (see sweep/job.py)
        from .sweep.job import run_job

        return run_job(cfg)
    try:
        rec = run(cfg)
    except OSError as e:  # a full or read-only disk (the record): here, not raised through
        # Hydra, which would print its own line for a job that raised
        from .sweep.table import write_error_line

        print(f"error: {write_error_line(e)}", file=sys.stderr)
        sys.exit(EXIT_FAILED)
    if rec is None:  # a rank other than 0 under torchrun: rank 0 reports
        return None
    if rec["status"] != "ok":
        sys.exit(EXIT_INVALID if rec["status"] in ("invalid", "skipped") else EXIT_FAILED)
    return rec


def hydra_error_line(e: Exception) -> str:
    """One line for Hydra's own config errors: the key (or group), then what went wrong."""
    from hydra.errors import MissingConfigException, OverrideParseException

    if isinstance(e, OverrideParseException):
        return parse_error_line(e.override, e.message)
    if isinstance(e, MissingConfigException) and e.options and e.missing_cfg_file:
        group, _, name = e.missing_cfg_file.rpartition("/")
        return f"{group}: '{name}' is not one of: {', '.join(e.options)}"
    cause = e.__cause__
    key = getattr(cause, "full_key", None) or ""
    typ = getattr(cause, "object_type", None)
    if key and type(cause).__name__ == "ConfigAttributeError" and dataclasses.is_dataclass(typ):
        from .validate import no_such_key  # an unknown key (without `+`): the keys there

        return f"{key}: {no_such_key(key.rpartition('.')[0], typ)}"
    # all of Hydra's lines (the second is often the fix: "use +seed_row=all"); of OmegaConf's
    # cause the first (the rest repeat the key and its type)
    lines = [x.strip().rstrip(".") for x in str(e).splitlines() if x.strip()]
    if cause is not None and str(cause).strip():
        lines.append(str(cause).strip().splitlines()[0].rstrip("."))
    what = "; ".join(lines)
    return f"{key}: {what}" if key else what


def interpolation_error_line(e: Exception, argv) -> str:
    """A ${...} Hydra resolves before the run (hydra.run.dir, hydra.job.name, --cfg --resolve):
    the override that holds it where the command line has one, and OmegaConf's first line."""
    key = getattr(e, "full_key", None) or "config"
    what = (str(e).splitlines() or [""])[0]
    sets = [a.lstrip("+~").split("=", 1) for a in argv if "=" in a and not a.startswith("-")]
    k, v = next((kv for kv in sets if kv[0] == key), None) or \
        next((kv for kv in sets if "${" in kv[1] and (kv[0].startswith("hydra.") or
                                                     key == "config")), (key, None))
    if v is None:
        return f"{key}: does not resolve: {what}"
    return f"{k}: '{v}' does not resolve: {what}" + (f" (read by {key})" if key not in
                                                      (k, "config") else "")


def parse_error_line(override: str, message: str) -> str:
    """An override Hydra's grammar cannot read: the character, and the fix where it is in the
    value (a path with ~ or a space: quote it)."""
    lines = [x for x in message.splitlines() if x.strip()]
    url = next((x.split()[1] for x in lines if x.startswith("See ")), None)
    lines = [x for x in lines if not x.startswith(("See ", "Error parsing override"))]
    what = lines[0] if lines else message
    lexer = "LexerNoViableAltException: "
    if what.startswith(lexer) and len(lines) > 1 and "^" in lines[1]:
        at = lines[1].index("^") - len(lexer)
        key, sep, value = override.partition("=")
        what = f"Hydra cannot read {override[at]!r} here" if 0 <= at < len(override) else what
        if sep and at > len(key):
            from .config import override_word

            what += f"; quote the value: {override_word(key, value)}"
    return f"override '{override}': {what}" + (f" (the grammar: {url})" if url else "")


def _hydra_args(argv) -> tuple[list[str], bool] | None:
    """The overrides of a command line as Hydra reads it, and whether it is a multirun (-m,
    --multi, hydra.mode=MULTIRUN); None where it runs nothing (--cfg, --info, --help) or
    Hydra's parser refuses it (its own usage line follows)."""
    a = _flags(argv)
    if a is None:
        return None
    if a.help or a.hydra_help or a.cfg or a.info or a.shell_completion:
        return None
    multirun = a.multirun or any(o.replace(" ", "").lstrip("+") == "hydra.mode=MULTIRUN"
                                 for o in a.overrides)
    return list(a.overrides), multirun


def _flags(argv):
    """Hydra's parse of a command line; None where its parser refuses it or prints and
    exits (a usage error, --version: Hydra's to print, once)."""
    import contextlib
    import io

    from hydra._internal.utils import get_args_parser

    try:
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            return get_args_parser().parse_known_args(list(argv))[0]
    except SystemExit:
        return None


def flag_error(argv) -> str | None:
    """Hydra's own flag conflicts (it raises a ValueError for them: a traceback)."""
    a = _flags(argv)
    if a is None:
        return None
    if a.run + (a.cfg is not None) + a.multirun + a.shell_completion + (a.info is not None) > 1:
        return "only one of --run, --multirun (-m), --cfg, --info and --shell-completion at a time"
    if a.resolve and a.cfg is None and not a.help:
        return "--resolve goes with --cfg or --help"
    if a.shell_completion and sum(o.split("=", 1)[0] in ("install", "uninstall", "query")
                                  for o in a.overrides) != 1:
        return ("--shell-completion (-sc) takes one of install=SHELL, uninstall=SHELL, "
                "query=SHELL (eval \"$(python -m moe_exp.run -sc install=bash)\")")
    if a.experimental_rerun is not None:  # (it skips the set-up a run records itself with)
        return ("--experimental-rerun is not supported: rerun with the overrides of the run's "
                "record (metrics.json `overrides`, or .hydra/overrides.yaml)")
    return None


NAME_MAX = 255  # bytes in a file name (Linux, macOS)


def job_name_error(args) -> str | None:
    """hydra.job.name names the run's log file (<name>.log in its dir): a path there would
    write it elsewhere."""
    read = _hydra_args(args)
    for o in read[0] if read else []:
        key, _, value = o.lstrip("+").partition("=")
        if key == "hydra.job.name" and ("/" in value or value.strip(" '\"") in ("", ".", "..")
                                        or len(f"{value}.log".encode()) > NAME_MAX):
            return (f"hydra.job.name: {value[:40]!r}{'...' if len(value) > 40 else ''} names "
                    f"the run's log file: a plain name (no '/', not '.' or '..', at most "
                    f"{NAME_MAX - 4} bytes)")
    return None


def _overrides(args) -> list[str]:
    """The overrides of a command line, --cfg / --info / --help ones too (Hydra composes
    the config for those as well); [] where Hydra's parser refuses it."""
    a = _flags(args)
    return list(a.overrides) if a is not None and not a.shell_completion else []


def group_value_error(args) -> str | None:
    """A number or bool as a config group's option (model=5, hardware=true): Hydra raised a
    ValueError for it (a 39-line traceback)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ChoiceSweep

    from .config import group_options

    groups = set(group_options_all())
    for o in _overrides(args):
        key = o.split("=", 1)[0].lstrip("+~")
        if key not in groups or "=" not in o:
            continue
        try:
            value = OverridesParser.create().parse_override(o).value()
        except Exception:  # noqa: BLE001 - a syntax error: Hydra's own line says it
            continue
        for v in value.list if isinstance(value, ChoiceSweep) else [value]:
            if isinstance(v, (bool, int, float)):
                text = o.split("=", 1)[1] if not isinstance(value, ChoiceSweep) else \
                    str(v).lower() if isinstance(v, bool) else str(v)
                return f"{key}: '{text}' is not one of: {', '.join(group_options(key))}"
    return None


def group_options_all() -> list[str]:
    """moe_exp's config groups (conf/hydra/ holds Hydra's own)."""
    from .config import CONF

    return sorted(p.name for p in CONF.iterdir()
                  if p.is_dir() and p.name[0] not in "_." and p.name != "hydra")


def output_dir_error(args) -> str | None:
    """An empty hydra.run.dir (hydra.sweep.dir, hydra.sweep.subdir) is the directory the
    command runs in (each job of a sweep, the sweep's dir): the run would write over the
    record there."""
    read = _hydra_args(args)
    for o in read[0] if read else []:
        key, _, value = o.lstrip("+").partition("=")
        if key in ("hydra.run.dir", "hydra.sweep.dir", "hydra.sweep.subdir") and \
                not value.strip(" '\"") and "=" in o:
            where = {"hydra.run.dir": "the run would write into the current dir, over any "
                     "record there; name a dir (e.g. outputs/mine)",
                     "hydra.sweep.dir": "the sweep would write into the current dir; name a "
                     "dir (e.g. multirun/mine)",
                     "hydra.sweep.subdir": "every job would write into the sweep's dir, each "
                     "over the last one's record"}[key]
            return f"{key}: empty: {where}, or leave it out"
    return None


def big_int_error(args) -> str | None:
    """An integer longer than Python converts (sys.get_int_max_str_digits(), 4300 digits):
    Hydra's parser raised a ValueError for it (a traceback)."""
    import re

    limit = sys.get_int_max_str_digits()
    if not limit:
        return None
    long = re.compile(r"\d{%d,}" % (limit + 1))
    for o in _overrides(args):
        if not (runs := long.findall(o)):
            continue
        from hydra.core.override_parser.overrides_parser import OverridesParser

        try:
            OverridesParser.create().parse_override(o)
        except ValueError as e:
            if "integer string conversion" not in str(e):
                continue  # (Hydra's own line says what is wrong)
            key = o.split("=", 1)[0].lstrip("+~")
            return (f"{key}: an integer of {max(map(len, runs))} digits is more than any "
                    f"setting takes (at most {limit} digits; --help lists each key's range)")
        except Exception:  # noqa: BLE001 - another syntax error: Hydra's own line says it
            continue
    return None


def twice_warnings(args) -> list[str]:
    """A key set more than once on the command line: Hydra silently takes the last value."""
    seen: dict[str, list[str]] = {}
    for o in _overrides(args):
        if o.startswith("~") or "=" not in o:
            continue
        key, value = o.lstrip("+").split("=", 1)
        seen.setdefault(key.strip(), []).append(value)
    return [f"warning: {k} is given {len(vs)} times ({', '.join(vs)}): the last is used, "
            f"{k}={vs[-1]}" for k, vs in seen.items() if len(vs) > 1]


def group_override_error(args) -> str | None:
    """Hydra takes a config group set to null (it then fails with a traceback), to a list
    (it merges every listed config into one run) or deleted (`~model`: the schema's
    defaults run), and a sweep preset or setting without -m (one default run): one line
    for each instead."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ChoiceSweep

    from .config import default_choices, group_options

    read = _hydra_args(args)
    if read is None:  # --cfg, --info, --help: nothing runs; or Hydra's own usage error
        return None
    args, multirun = read
    if not multirun and (a := next((a for a in args if a.split("=", 1)[0].lstrip("+~")
                                    .startswith("sweep.")), None)):
        return (f"{a.split('=', 1)[0].lstrip('+~')}: a sweep's setting, read only with -m "
                f"(python -m moe_exp.run -m {a} ...)")
    groups = set(group_options_all())
    mine = [a for a in args if a.split("=", 1)[0].lstrip("+~") in groups]
    if not mine:
        return None
    try:
        parsed = OverridesParser.create().parse_overrides(mine)
    except Exception:  # noqa: BLE001 - a syntax error: Hydra's own line says it
        return None
    for o in parsed:
        g = o.key_or_group
        if g not in groups:
            continue
        options = ", ".join(group_options(g))
        if o.is_delete():
            if g not in default_choices():  # (an optional group: Hydra's own line)
                continue
            return f"{g}: a run needs one option; it cannot be removed (one of: {options})"
        value = o.value()
        if g == "sweep" and isinstance(value, str) and not multirun:
            return (f"sweep: +sweep={value} is a sweep preset: run it with -m (python -m "
                    f"moe_exp.run -m +sweep={value})")
        for v in value.list if isinstance(value, ChoiceSweep) else [value]:
            if v is None:
                return f"{g}: null is not an option (one of: {options})"
            if isinstance(v, list):
                return (f"{g}: one option per run, got the list {o.input_line.split('=', 1)[1]} "
                        f"(a sweep over them: -m {o.input_line.split('=', 1)[0]}="
                        f"{','.join(map(str, v))})")
    return None


def writable_std() -> None:
    """A closed (`2>&-`) or read-only stdout / stderr becomes /dev/null: a progress bar or
    the summary cannot then fail the run (its record and run.log still say what happened)."""
    import fcntl

    for fd, name in ((1, "stdout"), (2, "stderr")):
        try:
            ok = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDONLY
        except OSError:  # closed
            ok = False
        if not ok:
            nul = os.open(os.devnull, os.O_WRONLY)
            if nul != fd:
                os.dup2(nul, fd)
                os.close(nul)
        if getattr(sys, name) is None:  # Python found the fd closed at start-up
            setattr(sys, name, open(fd, "w", buffering=1, closefd=False))


DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO)


@contextlib.contextmanager
def log_failures():
    """A log file that cannot be written (a full disk): logging printed a traceback for
    each line it could not write; here nothing, and the first such file and its problem go
    into the yielded list (cli says it once, at the end, where nothing else failed)."""
    import logging

    failed: list[tuple[str, str]] = []
    own = logging.FileHandler.handleError

    def handle_error(self, record):
        e = sys.exc_info()[1]
        if not isinstance(e, OSError):
            return own(self, record)
        if not failed:
            failed.append((self.baseFilename, os.strerror(e.errno) if e.errno else str(e)))

    logging.FileHandler.handleError = handle_error
    try:
        yield failed
    finally:
        logging.FileHandler.handleError = own


def _in_mkdir(e: BaseException) -> bool:
    """Whether the error came from making a directory (Hydra's output dir)."""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_code.co_name in ("mkdir", "makedirs")


def cli() -> None:
    """`python -m moe_exp.run`. Hydra's own config errors (unknown key or option, wrong type,
    bad override syntax) come out as one line and exit code 2, like moe_exp's checks;
    HYDRA_FULL_ERROR=1 keeps Hydra's own report."""
    from hydra.errors import CompactHydraException
    from omegaconf.errors import InterpolationResolutionError

    writable_std()
    stop_on_sigterm()
    full = os.environ.get("HYDRA_FULL_ERROR") == "1"
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra raises instead of printing and exiting 1
    args = sys.argv[1:]
    if (line := flag_error(args) or job_name_error(args) or output_dir_error(args) or
            group_value_error(args) or group_override_error(args) or
            big_int_error(args)) is not None and \
            (not full or line.startswith(("sweep.", "hydra.run", "hydra.sweep"))):  # (no
        # Hydra error to show for those)
        print(f"error: {line}", file=sys.stderr)
        sys.exit(EXIT_INVALID)
    for line in twice_warnings(args):
        print(line, file=sys.stderr)

    def write_error_line(e: OSError) -> str:
        from .sweep.table import write_error_line

        return write_error_line(e)

    try:
        with log_failures() as failed:
            main()
        callback = sys.modules.get("moe_exp.sweep.callback")
        if callback is not None and callback.NO_JOB_OK:  # a sweep whose table has no ok row
            sys.exit(EXIT_FAILED)
        if failed:  # the run (and its record) went on; its log is cut short
            print(f"error: cannot write {failed[0][0]}: {failed[0][1]} (the log stops there)",
                  file=sys.stderr)
            sys.exit(EXIT_FAILED)
    except CompactHydraException as e:
        if full:
            raise
        print(f"error: {hydra_error_line(e)}", file=sys.stderr)
        sys.exit(EXIT_INVALID)
    except InterpolationResolutionError as e:  # in Hydra's set-up, before any run
        if full or _STARTED:
            raise
        print(f"error: {interpolation_error_line(e, sys.argv[1:])}", file=sys.stderr)
        sys.exit(EXIT_INVALID)
    except OSError as e:  # Hydra's set-up (hydra.run.dir a file, or not writable), or a write
        # that failed later (a full or read-only disk: Hydra's config save, a record)
        if full:
            raise
        if e.filename and not _STARTED and e.errno not in DISK_FULL and _in_mkdir(e):
            print(f"error: cannot make the output dir '{e.filename}': {e.strerror}",
                  file=sys.stderr)
            sys.exit(EXIT_INVALID)
        print(f"error: {write_error_line(e)}", file=sys.stderr)
        sys.exit(EXIT_FAILED)
    except ValueError as e:  # logging's set-up could not open the run's log (read-only)
        if full or not isinstance(e.__cause__, OSError) or "configure handler" not in str(e):
            raise
        print(f"error: {write_error_line(e.__cause__)}", file=sys.stderr)
        sys.exit(EXIT_FAILED)
    except KeyboardInterrupt as e:  # the run's record (if it got one) says `crashed: interrupted`
        term = stop_signal(e) == "SIGTERM"
        print("terminated (SIGTERM)" if term else "interrupted", file=sys.stderr)
        sys.exit(143 if term else 130)


if __name__ == "__main__":
    cli()
