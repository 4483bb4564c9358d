"""The command line, `python -m moe_exp.run`: argument checks, Hydra's errors, exit codes.

The arguments are checked before Hydra reads them, and Hydra's errors come out as one line.
The run itself is pipeline.py's."""
from __future__ import annotations

import contextlib
import errno
import os
import sys

import hydra
from omegaconf import DictConfig

from . import config as _config  # noqa: F401  (registers the schemas)
from .config import nothing_left
from . import help as _help  # noqa: F401  (--help's resolvers)
from .hydra_internals import (flag_error, flags, hydra_args, hydra_error_line,
                              interpolation_error_line)
from .pipeline import hydra_info, run
from .results import stop_on_sigterm, stop_signal
from .sweep.callback import no_job_ok, release_held


EXIT_INVALID, EXIT_FAILED = 2, 1
_STARTED = False  # main() has been called: Hydra's own set-up (the output dir) is done

@hydra.main(version_base="1.3", config_path="conf", config_name="run")
def main(cfg: DictConfig) -> dict:
    global _STARTED
    _STARTED = True
    if hydra_info()[3]:  # a sweep job: in its own process, never raises (see sweep/job.py)
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
    if rec["status"] != "ok" and not nothing_left(rec):
        sys.exit(EXIT_INVALID if rec["status"] in ("invalid", "skipped") else EXIT_FAILED)
    return rec

NAME_MAX = 255  # bytes in a file name (Linux, macOS)

def job_name_error(args) -> str | None:
    """One line for a hydra.job.name that is not a plain file name.

    hydra.job.name names the run's log file, <name>.log in its dir: a path there would
    write it elsewhere."""
    read = hydra_args(args)
    for o in read[0] if read else []:
        key, _, value = o.lstrip("+").partition("=")
        if key == "hydra.job.name" and ("/" in value or value.strip(" '\"") in ("", ".", "..")
                                        or len(f"{value}.log".encode()) > NAME_MAX):
            return (f"hydra.job.name: {value[:40]!r}{'...' if len(value) > 40 else ''} names "
                    f"the run's log file: a plain name (no '/', not '.' or '..', at most "
                    f"{NAME_MAX - 4} bytes)")
    return None

def _overrides(args) -> list[str]:
    """A command line's overrides, under --cfg, --info and --help too; [] where Hydra refuses it.

    Hydra composes the config for those as well."""
    a = flags(args)
    return list(a.overrides) if a is not None and not a.shell_completion else []

def _values(args, keep):
    """(key, override text, its parsed value, each value it gives) of the command line's
    overrides whose key keep(key) takes; one Hydra cannot parse is Hydra's to report."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ChoiceSweep

    for o in _overrides(args):
        key = o.split("=", 1)[0].lstrip("+~")
        if "=" not in o or not keep(key):
            continue
        try:
            value = OverridesParser.create().parse_override(o).value()
        except Exception:  # noqa: BLE001 - a syntax error: Hydra's own line says it
            continue
        for v in value.list if isinstance(value, ChoiceSweep) else [value]:
            yield key, o, value, v


def group_value_error(args) -> str | None:
    """One line for a number or bool as a config group's option, e.g. model=5, hardware=true.

    Hydra raises a ValueError for it, with a traceback."""
    from hydra.core.override_parser.types import ChoiceSweep

    from .config import group_options

    groups = set(group_options_all())
    for key, o, value, v in _values(args, groups.__contains__):
        if isinstance(v, (bool, int, float)):
            text = o.split("=", 1)[1] if not isinstance(value, ChoiceSweep) else \
                str(v).lower() if isinstance(v, bool) else str(v)
            return f"{key}: '{text}' is not one of: {', '.join(group_options(key))}"
    return None

def bool_value_error(args) -> str | None:
    """One line for a value other than true or false given to a true/false key.

    OmegaConf reads any non-zero number, and yes or on, as true: train.profile=2 would run."""
    from .config import DEFAULTS

    for key, o, _, v in _values(args, lambda k: isinstance(DEFAULTS.get(k), bool)):
        if not o.startswith("~") and not isinstance(v, bool):
            return f"{key}: must be true or false, got {v}"
    return None


def group_options_all() -> list[str]:
    """moe_exp's config groups, less conf/hydra/, which holds Hydra's own."""
    from .config import CONF

    return sorted(p.name for p in CONF.iterdir()
                  if p.is_dir() and p.name[0] not in "_." and p.name != "hydra")

def output_dir_error(args) -> str | None:
    """One line for an empty hydra.run.dir, hydra.sweep.dir or hydra.sweep.subdir.

    Empty, it is the directory the command runs in, or for a sweep's jobs the sweep's dir:
    the run would write over the record there."""
    read = hydra_args(args)
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
    """One line for an integer longer than Python converts: sys.get_int_max_str_digits().

    Hydra's parser raises a ValueError for it, with a traceback."""
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
    """Warnings for a key set more than once on the command line: Hydra silently takes the last."""
    seen: dict[str, list[str]] = {}
    for o in _overrides(args):
        if o.startswith("~") or "=" not in o:
            continue
        key, value = o.lstrip("+").split("=", 1)
        seen.setdefault(key.strip(), []).append(value)
    return [f"warning: {k} is given {len(vs)} times ({', '.join(vs)}): the last is used, "
            f"{k}={vs[-1]}" for k, vs in seen.items() if len(vs) > 1]

def group_override_error(args) -> str | None:
    """One line for a config group override or sweep setting that Hydra takes but should not.

    A group set to null, which then fails with a traceback; set to a list, which merges
    every listed config into one run; or deleted, as `~model`, which runs the schema's
    defaults. Also a sweep preset or setting without -m, which makes one default run."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ChoiceSweep

    from .config import default_choices, group_options

    read = hydra_args(args)
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
    """Points a closed or read-only stdout or stderr, e.g. `2>&-`, at /dev/null.

    A progress bar or the summary then cannot fail the run; its record and run.log still
    say what happened."""
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
    """Silences failed log writes, as on a full disk; the first file and its problem are yielded.

    logging's own handler prints a traceback for each line it cannot write; here nothing is
    printed. cli says it once, at the end, where nothing else failed."""
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
    """Whether the error came from making a directory, as Hydra's output dir."""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_code.co_name in ("mkdir", "makedirs")

def help_topic(args) -> int | None:
    """`--help WORD ...`: prints each key's or group's whole text; the exit code, or None
    where the line is not that (plain --help is Hydra's page, its keys cut to one line)."""
    a = flags(args)
    words = [o for o in a.overrides if "=" not in o] if a is not None and a.help else []
    if not words:
        return None
    texts = [_help.topic_text(w) for w in words]
    for w, text in zip(words, texts):
        if text is None:
            print(f"error: --help {w}: no key or config group of that name (--help alone "
                  "lists them)", file=sys.stderr)
            return EXIT_INVALID
    print("\n\n".join(texts))
    return 0

def register_search_sweeper() -> None:
    """Registers +sweep=search's and +sweep=layouts' sweepers, hydra_plugins/moe_exp_search,
    with Hydra.

    Hydra's plugin scan misses a namespace package that an editable install maps through an
    import hook. Optuna is imported only when the sweeper is made."""
    from hydra.core.plugins import Plugins
    from hydra_plugins.moe_exp_search.layout_sweeper import LayoutSweeper
    from hydra_plugins.moe_exp_search.search_sweeper import SearchSweeper

    Plugins.instance().register(SearchSweeper)
    Plugins.instance().register(LayoutSweeper)


def cli() -> None:
    """`python -m moe_exp.run`: checks the arguments, runs Hydra, sets the exit code.

    Hydra's own config errors, such as an unknown key or option, a wrong type or bad
    override syntax, come out as one line and exit code 2, like moe_exp's checks;
    HYDRA_FULL_ERROR=1 keeps Hydra's own report."""
    from hydra.errors import CompactHydraException
    from omegaconf.errors import InterpolationResolutionError

    writable_std()
    stop_on_sigterm()
    register_search_sweeper()
    full = os.environ.get("HYDRA_FULL_ERROR") == "1"
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra raises instead of printing and exiting 1
    args = sys.argv[1:]
    if (topic := help_topic(args)) is not None:
        sys.exit(topic)
    if (line := flag_error(args) or job_name_error(args) or output_dir_error(args) or
            group_value_error(args) or group_override_error(args) or
            big_int_error(args) or bool_value_error(args)) is not None and \
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
        if no_job_ok():  # a sweep whose table has no ok row
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
    finally:
        release_held()  # a sweep's lock files, however it ended
