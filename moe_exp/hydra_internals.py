"""Hydra's private APIs, in this one module.

Its errors as one line, its argument parser, its basic sweeper's split of a sweep into jobs."""
from __future__ import annotations

import dataclasses

from omegaconf import DictConfig

from .config import override_texts


def hydra_error_line(e: Exception) -> str:
    """One line for Hydra's own config errors: the key or group, then what went wrong."""
    from hydra.errors import MissingConfigException, OverrideParseException

    if isinstance(e, OverrideParseException):
        return parse_error_line(e.override, e.message)
    if isinstance(e, MissingConfigException) and e.options and e.missing_cfg_file:
        group, _, name = e.missing_cfg_file.rpartition("/")
        hint = " (the Optuna sweeper of +sweep=search: pip install -e \".[search]\")" \
            if group == "hydra/sweeper" and name == "optuna" else ""
        return f"{group}: '{name}' is not one of: {', '.join(e.options)}{hint}"
    cause = e.__cause__
    key = getattr(cause, "full_key", None) or ""
    typ = getattr(cause, "object_type", None)
    if key and type(cause).__name__ == "ConfigAttributeError" and dataclasses.is_dataclass(typ):
        from .config import no_such_key  # an unknown key (without `+`): the keys there

        return f"{key}: {no_such_key(key.rpartition('.')[0], typ)}"
    # all of Hydra's lines (the second is often the fix: "use +seed_row=all"); of OmegaConf's
    # cause the first (the rest repeat the key and its type)
    lines = [x.strip().rstrip(".") for x in str(e).splitlines() if x.strip()]
    if cause is not None and str(cause).strip():
        lines.append(str(cause).strip().splitlines()[0].rstrip("."))
    what = "; ".join(lines)
    return f"{key}: {what}" if key else what

def interpolation_error_line(e: Exception, argv) -> str:
    """One line for a ${...} that Hydra fails to resolve before the run.

    Such are hydra.run.dir, hydra.job.name and any under --cfg --resolve. The line names the
    override that holds it where the command line has one, then OmegaConf's first line."""
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
    """One line for an override Hydra's grammar cannot read: the character, and the fix.

    The fix is given where the character is in the value, e.g. a path with ~ or a space:
    quote it."""
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

def hydra_args(argv) -> tuple[list[str], bool] | None:
    """The overrides of a command line as Hydra reads it, and whether it is a multirun.

    A multirun is -m, --multirun or hydra.mode=MULTIRUN. None where the line runs nothing,
    as with --cfg, --info or --help, or where Hydra's parser refuses it: Hydra's own usage
    line follows."""
    a = flags(argv)
    if a is None:
        return None
    if a.help or a.hydra_help or a.cfg or a.info or a.shell_completion:
        return None
    multirun = a.multirun or any(o.replace(" ", "").lstrip("+") == "hydra.mode=MULTIRUN"
                                 for o in a.overrides)
    return list(a.overrides), multirun

def flags(argv):
    """Hydra's parse of a command line; None where its parser refuses it or prints and exits.

    The parse's output is swallowed: a usage error or --version is Hydra's to print, once."""
    import contextlib
    import io

    from hydra._internal.utils import get_args_parser

    try:
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            return get_args_parser().parse_known_args(list(argv))[0]
    except SystemExit:
        return None

def flag_error(argv) -> str | None:
    """Hydra's own flag conflicts as one line, where Hydra would raise a ValueError's traceback."""
    a = flags(argv)
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


def plan(config: DictConfig) -> tuple[list[list[str]] | None, dict]:
    """A sweep's jobs and the keys that vary, as the basic sweeper splits it.

    Returns each job's overrides and {key that varies: its values as written, quotes kept}.
    For a search, the Optuna sweeper, the jobs are None and the values its choice(...)
    values; (None, {}) where the sweeper is unknown. A key swept twice, by a preset and the
    command line, takes the command line's values."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.global_hydra import GlobalHydra

    search = is_search(config.hydra.sweeper)
    if "BasicSweeper" not in str(config.hydra.sweeper.get("_target_", "")) and not search:
        return None, {}
    try:  # (the config loader lists a group's options for glob(...), as the sweeper's does)
        loader = GlobalHydra.instance().hydra.config_loader if GlobalHydra.instance(
        ).is_initialized() else None
        parsed = swept(config, loader)
        jobs = None if search else BasicSweeper.split_arguments(parsed, None)[0]
    except Exception:  # noqa: BLE001 - progress is a nicety; Hydra reports real errors
        return None, {}
    # (a search: its choice(...) values, checked before any trial; its number of jobs is
    # the sampler's to decide)
    varying = {o.get_key_element(): list(o.sweep_string_iterator())  # as written: '1e-3'
               for o in parsed if o.is_sweep_override()  # stays quoted (a string)
               and (not search or type(o.value()).__name__ == "ChoiceSweep")}
    return jobs, varying


def swept(config: DictConfig, loader=None) -> list:
    """The sweep's overrides as Hydra parses them: hydra.sweeper.params, then the command
    line's (so a key given in both takes the command line's)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    params = [f"{k}={v}" for k, v in (config.hydra.sweeper.get("params") or {}).items()]
    return OverridesParser.create(config_loader=loader).parse_overrides(
        params + override_texts(config.hydra.overrides.task))


def search_space(config: DictConfig) -> dict[str, list]:
    """A search's swept keys, each with the values to check before any trial, as Hydra
    parsed them: a choice's or a range's, an interval's two bounds.

    Raises ValueError for an interval whose low bound is not below its high one, or a log
    one not above 0."""
    from hydra.core.override_parser.types import IntervalSweep

    space = {}
    for o in swept(config):
        if not o.is_sweep_override():
            continue
        key, v = o.get_key_element(), o.value()
        if isinstance(v, IntervalSweep):
            if not v.start < v.end or "log" in v.tags and v.start <= 0:
                low = "above 0 and " if "log" in v.tags else ""
                raise ValueError(f"{key}: interval({v.start:g}, {v.end:g}): its low bound must "
                                 f"be {low}below its high one")
            space[key] = [v.start, v.end]
        else:
            space[key] = list(o.sweep_iterator())
    return space


def is_search(sweeper) -> bool:
    """Whether hydra.sweeper is the Optuna sweeper: +sweep=search's, or the plugin's own.

    Its trials return values, not records, and its number of trials is the sampler's."""
    target = str(sweeper.get("_target_", ""))
    return "optuna" in target.lower() or target.endswith(".SearchSweeper")
