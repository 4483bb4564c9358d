import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
if (os.cpu_count() or 1) <= 4:  # (a GPU machine's 16 cores compile in parallel)
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):  # pytest -n N: a core per worker, and its runs'
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # (torch's threads of two workers on 2
    torch.set_num_threads(1)  # cores wait for each other: a step 40x slower)

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "moe_exp" / "conf"


def compose(overrides=()):
    from hydra import compose as hcompose
    from hydra import initialize_config_module

    with initialize_config_module(config_module="moe_exp.conf", version_base="1.3"):
        return hcompose("run", overrides=list(overrides))


def off_contract(rec: dict) -> set:
    """A record's keys that its declaration (moe_exp/record.py) does not name, or whose
    value is not of the declared type."""
    from moe_exp.record import check

    return {line.split(":")[0] for line in check(rec)}


def run_inproc(overrides, out_dir):
    """One run in this process (progress bar off), its overrides as the CLI gives them;
    returns the record."""
    from moe_exp.run import run

    return run(compose(overrides), out_dir=out_dir, progress=False, overrides=list(overrides))


def run_cli(args, cwd, timeout=300, env=None):
    """`python -m moe_exp.run ARGS` in a process of its own."""
    return python(["-m", "moe_exp.run", *args], cwd, timeout, env)


def python(argv, cwd, timeout=300, env=None):
    """`python ARGV` (`-m MODULE ...` or `SCRIPT ...`) in a process of its own, its output
    captured: forked from a server that imported torch once where the environment allows
    (tests/forkrun.py), else a fresh interpreter."""
    from forkrun import forkable, run

    e = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    if forkable(e):
        return run(argv, cwd, e, timeout)
    return subprocess.run([sys.executable, *map(str, argv)], cwd=cwd, env=e,
                          capture_output=True, text=True, timeout=timeout)


def cli_inproc(args, cwd):
    """`python -m moe_exp.run ARGS` in this process, for commands refused before any run or
    job (what they test is the line and the exit code, not a process: run_cli's 3 s of
    start-up each); one at a time (sys.argv, the cwd). Returns a CompletedProcess."""
    import logging
    import signal

    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    import moe_exp.cli as cli

    saved = (sys.argv, os.getcwd(), os.environ.get("HYDRA_FULL_ERROR"),
             signal.getsignal(signal.SIGTERM), cli._STARTED, HydraConfig.instance().cfg)
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level  # (Hydra's job logging: the run's log)
    try:
        sys.argv = ["moe_exp.run", *args]
        os.chdir(cwd)
        return as_process(args, cli.cli)
    finally:
        sys.argv = saved[0]
        os.chdir(saved[1])
        if saved[2] is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = saved[2]
        signal.signal(signal.SIGTERM, saved[3])
        cli._STARTED = saved[4]
        HydraConfig.instance().cfg = saved[5]  # (an error in Hydra's set-up left its own)
        GlobalHydra.instance().clear()
        for h in root.handlers:
            if h not in handlers:
                h.close()
        root.handlers[:], root.level = handlers, level


def as_process(args, main):
    """main() in this process with its output captured and its exit turned into a code,
    as a CompletedProcess (an exception other than SystemExit fails the test)."""
    import contextlib
    import io

    out, err, code = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main()
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def in_pairs(fn, items):
    """[fn(*item) for item in items], two at a time: for subprocesses that mostly start
    (import torch, compose the config) and fail, which one core each serves."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(lambda item: fn(*item), items))


def cli_runs(tmp_path_factory, cases):
    """run_cli for each (args, env) of `cases`, in_pairs, each in a folder of its own ("{cwd}"
    in an argument: that folder), for a module fixture: a parametrized test's runs ahead of
    its cases, two at a time. Returns {cli_key(args, env): (CompletedProcess, folder)}."""
    base = tmp_path_factory.mktemp("cli")

    def one(i, args, env):
        cwd = base / str(i)
        cwd.mkdir()
        return run_cli([a.replace("{cwd}", str(cwd)) for a in args], cwd, env=env), cwd

    done = in_pairs(one, [(i, args, env) for i, (args, env) in enumerate(cases)])
    return {cli_key(args, env): r for (args, env), r in zip(cases, done)}


def cli_key(args, env=None):
    return tuple(args), tuple(sorted((env or {}).items()))


# Modules with module-scoped fixtures (ranks' launches, a sweep, a cold compile, CLI runs)
# shared by several tests: under pytest -n each goes to one worker whole (the fixture once)
ONE_WORKER = {f"tests/{p.name}" for p in Path(__file__).parent.glob("test_*.py")
              if 'fixture(scope="module")' in p.read_text()}


@pytest.hookimpl(optionalhook=True)  # (a hook of pytest-xdist's)
def pytest_xdist_make_scheduler(config, log):
    """pytest -n: xdist's load scheduling, but each ONE_WORKER module a unit (largest units
    first); every other test its own unit. (xdist's own loadgroup does not group under
    pytest 9.2: pytest-dev/pytest-xdist#1386.)"""
    from xdist.scheduler import LoadScopeScheduling

    class Scheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            module = nodeid.split("::")[0]
            return module if module in ONE_WORKER else nodeid

    return Scheduling(config, log)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none is visible")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
