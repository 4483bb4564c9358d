"""moe_exp's `+sweep=search` sweeper: Hydra's Optuna sweeper, the baseline its first trial.

The precisions this machine cannot run are left out; see moe_exp.sweep.searcher. Hydra
takes sweepers only from this namespace. Optuna is imported when the sweeper is made, so
Hydra's plugin scan needs no Optuna."""
from hydra.plugins.sweeper import Sweeper


class SearchSweeper(Sweeper):
    def __init__(self, **kwargs) -> None:
        from hydra_plugins.hydra_optuna_sweeper.optuna_sweeper import OptunaSweeper

        self.optuna = OptunaSweeper(**kwargs)

    def setup(self, **kwargs) -> None:
        self.optuna.setup(**kwargs)

    def sweep(self, arguments):
        from moe_exp.sweep.searcher import (drop_unrunnable, enqueue_baseline, quiet_optuna,
                                            save_config)

        save_config(self.optuna.sweeper.config)  # multirun.yaml, as a grid sweep's dir has
        quiet_optuna()
        arguments = drop_unrunnable(self.optuna.sweeper, arguments)
        enqueue_baseline(self.optuna.sweeper, arguments)
        return self.optuna.sweep(arguments)
