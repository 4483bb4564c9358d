"""`+sweep=search`'s study starts from the baseline, so every later trial has a row to be
compared with (used by hydra_plugins/moe_exp_search, the sweeper Hydra instantiates)."""
from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def register() -> None:
    """Make the sweeper known to Hydra: its plugin scan misses a namespace package that an
    editable install (pip install -e) maps through an import hook (Hydra's own
    Plugins.register; a regular install is found by the scan as well)."""
    from hydra.core.plugins import Plugins
    from hydra_plugins.moe_exp_search.search_sweeper import SearchSweeper

    Plugins.instance().register(SearchSweeper)


def enqueue_baseline(impl, arguments: list[str]) -> None:
    """A new study (none in the storage yet) gets one trial enqueued: the first value of
    each choice(...) of the space (a preset puts every optimization's off first). `impl`:
    hydra-optuna-sweeper's OptunaSweeperImpl, before its sweep()."""
    import optuna
    from hydra_plugins.hydra_optuna_sweeper._impl import create_params_from_overrides

    impl._process_searchspace_config()
    space, _ = create_params_from_overrides([*impl._parse_sweeper_params_config(),
                                             *arguments])
    first = {k: d.choices[0] for k, d in space.items()
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
