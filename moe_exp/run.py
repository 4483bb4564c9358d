"""The entrypoint: compose -> validate -> build -> optimize -> bench -> record.

    python -m moe_exp.run [group=option ...] [key=value ...]

`run(cfg)` runs one composed config in this process (pipeline.py); `cli()` is the command
line (cli.py).
"""
from .cli import cli, main  # noqa: F401
from .pipeline import prepare, run  # noqa: F401

if __name__ == "__main__":
    cli()
