"""`python -m MODULE ARGS` or `python SCRIPT ARGS` as a process of its own, forked from a
server that imported torch, dynamo and the package once (multiprocessing's forkserver): the
command's own pid, exit code, output, environment and cwd, without its ~4 CPU-s of imports
each (most of a short run's cost on 2 cores). An environment that differs from the
server's in a variable read at import time (OMP_NUM_THREADS, TORCHINDUCTOR_*) gets a fresh
interpreter instead. Tests of a process's start itself (signals, the memory baseline) use
subprocess directly."""
import atexit
import multiprocessing as mp
import os
import runpy
import subprocess
import sys
import tempfile
import traceback

PRELOAD = ["torch", "torch._dynamo", "torch._inductor.config", "hydra", "omegaconf",
           "moe_exp.cli", "moe_exp.pipeline", "moe_exp.tasks.bench"]
# read when used, not at import: may differ from the server's
RUNTIME = {"PYTEST_CURRENT_TEST", "PYTHONPATH", "WANDB_MODE", "WANDB_SILENT", "HYDRA_FULL_ERROR",
           "TORCHINDUCTOR_CACHE_DIR"}  # (inductor's cache_dir() reads it at each call)
_server = {}


def _context():
    if not _server:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        _server.update(ctx=ctx, env=dict(os.environ))
    return _server["ctx"]


def forkable(env: dict) -> bool:
    _context()
    seen = _server["env"]
    return all(env.get(k) == seen.get(k) for k in {*env, *seen} - RUNTIME)


def run(argv, cwd, env, timeout):
    """subprocess.run([python, *argv], cwd, env, capture_output, text, timeout), argv
    `-m MODULE ARGS` or `SCRIPT ARGS`, in a forked process; a CompletedProcess
    (TimeoutExpired past timeout, the process killed)."""
    argv = [str(a) for a in argv]
    with tempfile.TemporaryDirectory() as tmp:  # (its output: files by name; a forkserver's
        out, err = os.path.join(tmp, "out"), os.path.join(tmp, "err")  # child gets no fds)
        p = _context().Process(target=_child, args=(argv, str(cwd), env, out, err))
        p.start()
        p.join(timeout)
        if p.exitcode is None:
            p.kill()
            p.join()
            raise subprocess.TimeoutExpired(argv, timeout)
        texts = [_text(f) for f in (out, err)]
    return subprocess.CompletedProcess(argv, p.exitcode, *texts)


def _text(path: str) -> str:
    """As subprocess's text=True reads it: universal newlines (a progress bar's \\r too)."""
    if not os.path.exists(path):
        return ""
    with open(path, "rb") as f:
        return f.read().decode(errors="replace").replace("\r\n", "\n").replace("\r", "\n")


def _child(argv, cwd, env, out, err):
    for path, fd in ((out, 1), (err, 2)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(f, fd)
        os.close(f)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    module = argv[1] if argv[0] == "-m" else None
    sys.argv = argv[1:] if module else argv
    # as python puts the cwd (-m) or the script's folder first
    sys.path.insert(0, cwd if module else os.path.dirname(os.path.abspath(argv[0])))
    code = 0
    try:
        if module:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()  # (multiprocessing's children skip them; python runs them)
    for s in (sys.stdout, sys.stderr):
        try:
            s.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
