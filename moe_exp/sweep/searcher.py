"""`+sweep=search`'s study set-up: the baseline first, unrunnable precisions left out.

Starting from the baseline gives every later trial a row to be compared with.
hydra_plugins/moe_exp_search, the sweeper Hydra instantiates, uses this; cli.py registers
that sweeper."""
from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def quiet_optuna() -> None:
    """Optuna's warnings only, through Hydra's logging (no colour codes in a log file).

    Its "new study" and "existing study" lines said nothing of use; the sweep prints a
    line per trial itself (sweep/callback.py)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    optuna.logging.disable_default_handler()
    optuna.logging.enable_propagation()


def save_config(config) -> None:
    """The sweep's config as multirun.yaml in its dir, as Hydra's grid sweeper saves it:
    report, compare and the notebook read it."""
    from pathlib import Path

    from omegaconf import OmegaConf

    sweep_dir = Path(config.hydra.sweep.dir)
    sweep_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(config, sweep_dir / "multirun.yaml")


def space(impl, arguments: list[str]) -> dict:
    """The search space as the sweeper parses it: {key: Optuna distribution}.

    From its hydra.sweeper.params and the command line's sweep arguments; the last of a key
    wins."""
    from hydra_plugins.hydra_optuna_sweeper._impl import create_params_from_overrides

    impl._process_searchspace_config()
    dists, _ = create_params_from_overrides([*impl._parse_sweeper_params_config(),
                                             *arguments])
    return dists


def enqueue_baseline(impl, arguments: list[str]) -> None:
    """Enqueue the baseline as a new study's first trial.

    A study is new where the storage has none yet. The baseline is the first value of each
    choice(...) of the space; a preset puts every optimization's off first. `impl` is
    hydra-optuna-sweeper's OptunaSweeperImpl, before its sweep()."""
    import optuna

    first = {k: d.choices[0] for k, d in space(impl, arguments).items()
             if isinstance(d, optuna.distributions.CategoricalDistribution)}
    if impl.storage is None:
        log.warning("hydra.sweeper.storage is null: the baseline is not enqueued first, and "
                    "the study cannot be resumed")
    elif first:
        study = optuna.create_study(study_name=impl.study_name, storage=impl.storage,
                                    directions=impl._get_directions(), load_if_exists=True)
        if not study.trials:
            import warnings

            with warnings.catch_warnings():  # (enqueue_trial is "experimental" in Optuna 2)
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                study.enqueue_trial(first)


def drop_unrunnable(impl, arguments: list[str]) -> list[str]:
    """The arguments, less the `precision` choices this machine cannot run, e.g. fp8 on a CPU.

    validate.precision_here decides. Each trial of one would be a skipped row, and the
    sampler learns nothing from a failed trial. Only where the jobs run here, not under
    submitit, and some value is left; it prints which went and why."""
    import optuna
    from omegaconf import OmegaConf

    from ..config import ConfigError, Unsupported
    from ..hardware import resolve
    from ..validate import precision_here

    if "submitit" in str(impl.config.hydra.launcher.get("_target_", "")):
        return arguments
    dists = space(impl, arguments)
    key = next((k for k in dists if k.lstrip("+") == "precision"), None)
    if key is None or not isinstance(dists[key], optuna.distributions.CategoricalDistribution):
        return arguments
    try:
        cfg = OmegaConf.create({"hardware": OmegaConf.to_container(impl.config.hardware,
                                                                   resolve=True),
                                "precision": {"name": None}})
        resolve(cfg)
    except (ConfigError, ValueError):  # (the jobs say what is wrong with the hardware)
        return arguments
    kept, why = [], {}
    for value in dists[key].choices:
        cfg.precision.name = str(value)
        try:
            precision_here(cfg)
            kept.append(str(value))
        except Unsupported as e:
            why[str(value)] = str(e).split(": ", 1)[-1]  # (without its key)
    if not why or not kept:
        return arguments
    from ..screen import wrapped

    print(wrapped(f"[search] {key}: {', '.join(why)} left out of the space, this machine "
                  f"cannot run them ({'; '.join(dict.fromkeys(why.values()))})"), flush=True)
    return [*arguments, f"{key}=choice({','.join(kept)})"]  # (the last one of a key wins)

