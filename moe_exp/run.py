"""The entrypoint: compose -> validate -> build -> optimize -> bench -> record.

    python -m moe_exp.run [group=option ...] [key=value ...]

`run(cfg)`, from pipeline.py, runs one composed config in this process; `cli()`, from
cli.py, is the command line.
"""
from .cli import cli, main  # noqa: F401
from .pipeline import prepare, run  # noqa: F401

if __name__ == "__main__":
    cli()
