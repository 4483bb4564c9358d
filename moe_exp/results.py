"""The result record: one per run, written as `metrics.json`, and a row per run in a sweep table."""
from __future__ import annotations

import datetime as dt
import hashlib
import json
import math
import os
import sys
import tempfile
from pathlib import Path

from .knobs import NEW
from .ranks import rank_env
from .record import SECTIONS, Header, columns, names

STATUSES = ("ok", "oom", "diverged", "invalid", "error", "crashed", "skipped")

# The contract of shared/DESIGN.md, in order (record.Header's first keys); extra keys follow.
FIELDS = names(Header)[:names(Header).index("timestamp") + 1]
# The extra keys runs write (record.py, docs/record.md): with FIELDS, the columns a
# sweep.baseline may name before any job has run.
EXTRAS = tuple(k for k in dict.fromkeys([*names(Header), *columns(),
                                         *(k for s in SECTIONS for k in names(s))])
               if k not in FIELDS)


def row_key(rec: dict) -> tuple:
    """What makes a row of a sweep table its own: the measured configuration and its labels.

    Runs that differ only in `extra` are one configuration, two rows. A table's `extra` is
    JSON text, made by sweep.table.flat."""
    extra = rec.get("extra")
    if isinstance(extra, str):
        try:
            extra = json.loads(extra)
        except ValueError:
            pass
    if not isinstance(extra, (dict, str)):  # none, or a table's NaN
        extra = {}
    return rec.get("config_hash"), json.dumps(extra, sort_keys=True, default=str)


def config_hash(cfg_dict: dict, world: int | None = None) -> str:
    """The configuration's hash: the first 12 hex digits of hashed_view's SHA-256.

    world is the ranks of a torchrun job over several nodes, where hardware.devices counts
    one node's; it is part of the hash where it differs from hardware.devices."""
    keep = hashed_view(cfg_dict)
    if world is not None and world != (cfg_dict.get("hardware") or {}).get("devices"):
        keep["world_size"] = world
    return hashlib.sha256(json.dumps(keep, sort_keys=True, default=str).encode()).hexdigest()[:12]


def hashed_view(cfg_dict: dict) -> dict:
    """What of a configuration its hash counts, from each key's declaration in config.py.

    It keeps the keys its task reads. A key its option does not read counts at its default,
    or is left out or kept, as Knob.unread says, so setting it splits no configuration in
    two. A key at Knob.since, the value it had before it existed, is left out, so older
    hashes stay valid for compare and resume. parallel.prefetch past the model's layers
    counts as prefetching all of them."""
    from .config import DEFAULTS, KNOBS, UNHASHED

    task = cfg_dict.get("task", "bench")
    keep = {k: (dict(v) if isinstance(v, dict) else v) for k, v in cfg_dict.items()
            if k not in UNHASHED}

    given = {k: (dict(v) if isinstance(v, dict) else v) for k, v in keep.items()}

    def get(dotted):  # (the options chosen: as given, not as this view leaves them)
        head, _, leaf = dotted.partition(".")
        node = given.get(head)
        return (node.get(leaf) if isinstance(node, dict) else None) if leaf else node

    if task != "bench":  # only what this task reads: of a group, its keys that it reads
        out = {}
        for k, v in keep.items():
            if k == "world_size" or k in KNOBS and KNOBS[k].read_in(task):
                out[k] = v
            elif isinstance(v, dict):
                mine = [n for n in KNOBS if n.startswith(f"{k}.") and KNOBS[n].read_in(task)]
                if mine:
                    out[k] = {n.split(".", 1)[1]: v.get(n.split(".", 1)[1]) for n in mine}
        keep = out
    for dotted, knob in KNOBS.items():
        head, _, leaf = dotted.partition(".")
        node = keep.get(head)
        if not leaf or not isinstance(node, dict) or leaf not in node:
            continue
        read = knob.read_in(task) and (not knob.read_by or any(r.holds(get)
                                                                for r in knob.read_by))
        if not read and knob.unread == "drop":
            del node[leaf]
            continue
        if not read and knob.unread == "default":
            node[leaf] = DEFAULTS[dotted]
        if knob.since is not NEW and node[leaf] == knob.since:
            del node[leaf]
    layers, par = get("model.num_layers"), keep.get("parallel")
    if isinstance(layers, int) and isinstance(par, dict) and par.get("prefetch", 0) > layers:
        par["prefetch"] = layers  # more acts as all of them
    return {k: v for k, v in keep.items() if v != {}}  # (a group of new keys at their since)


def new_record(cfg_dict: dict, overrides: list[str]) -> dict:
    """A new record with every field present: the configuration filled, measurements null.

    Each knob's column holds its value."""
    rec = dict.fromkeys(FIELDS)

    def get(dotted):  # (a failed record's config may lack a key: ~train)
        head, _, leaf = dotted.partition(".")
        node = cfg_dict.get(head)
        return (node if isinstance(node, dict) else {}).get(leaf) if leaf else node

    rec["task"] = cfg_dict.get("task", "bench")
    rec.update({c: get(key) for c, key in columns().items() if c != "task"})
    rec.update(status="error", overrides=list(overrides),
               config_hash=config_hash(cfg_dict, env.world if (env := rank_env()) else None),
               timestamp=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"))
    rec["extra"] = dict(cfg_dict.get("extra") or {})
    rec["null_reasons"] = {}
    return rec


def failed_record(cfg_dict: dict, overrides: list[str], status: str, error: str,
                  why: str) -> dict:
    """A record for a run that measured nothing: its status, one-line error and null reasons.

    `why` is the reason of every null measurement."""
    rec = new_record(cfg_dict, overrides)
    rec.update(status=status, error=error)
    fill_null_reasons(rec, why)
    return rec


def why_died(rc: int) -> str:
    """How a child process that wrote no record ended, from its return code."""
    import signal

    if rc < 0:
        name = signal.Signals(-rc).name if -rc in signal.Signals._value2member_map_ else -rc
        oom = " (the kernel's OOM killer sends SIGKILL)" if -rc == signal.SIGKILL else ""
        return f"was killed by {name}{oom}"
    return f"exited with code {rc} before writing its record"


def finite(obj):
    """obj with each nan and inf, at any depth, as None: JSON has neither."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def write_json_atomic(path: str | Path, obj) -> None:
    """Write obj as JSON to path atomically, through a temporary file and a rename.

    A failed write, as on a full or read-only disk, leaves no temporary file, and its OSError
    names `path`, which a write's own does not."""
    path, tmp = Path(path), None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would outlive the rename
        with os.fdopen(fd, "w") as f:
            json.dump(finite(obj), f, indent=2, default=str, allow_nan=False)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException as e:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise OSError(e.errno, e.strerror or str(e), str(path)) from None
        raise


def stop_on_sigterm() -> None:
    """Make SIGTERM stop a run as Ctrl-C does, by raising KeyboardInterrupt("SIGTERM").

    SIGTERM comes from timeout, SLURM's scancel or time limit, or docker stop. The run's
    record then says crashed: interrupted, and a sweep's table keeps its rows. It acts once:
    a second SIGTERM is ignored while those are written."""
    import signal

    def stop(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise KeyboardInterrupt("SIGTERM")

    try:
        signal.signal(signal.SIGTERM, stop)
    except ValueError:  # not the main thread
        pass


def stop_signal(e: BaseException) -> str:
    """What stopped a run, from its KeyboardInterrupt; see stop_on_sigterm."""
    return "SIGTERM" if e.args[:1] == ("SIGTERM",) else "Ctrl-C / SIGINT"


def hold_sigint():
    """Ignore SIGINT while an interrupted run's record and table are written.

    A second Ctrl-C would cut them short. Returns the handler to put back, or None off the
    main thread, where it cannot be set."""
    import signal

    try:
        return signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread
        return None


def release_sigint(held) -> None:
    if held is not None:
        import signal

        signal.signal(signal.SIGINT, held)


def close_record(rec: dict, out_dir, tracker=None, noun: str = "run",
                 show_error: bool = True) -> None:
    """End a run: its error on stderr, a reason for every null, metrics.json, the tracker's end.

    The tracker gets the record's summary, then finishes."""
    if show_error and rec["status"] != "ok" and rec["error"]:
        print(f"error: {noun} {rec['status']}: {rec['error']}\nrecord: "
              f"{out_dir / 'metrics.json'}", file=sys.stderr)
    for k, v in rec.items():  # (written as null: JSON has no nan)
        if isinstance(v, float) and not math.isfinite(v) and k != "null_reasons":
            rec["null_reasons"].setdefault(k, f"not a finite number ({v})")
            rec[k] = None
    fill_null_reasons(rec, f"not measured: run {rec['status']}")
    write_json_atomic(out_dir / "metrics.json", rec)
    if tracker:
        tracker.summary(rec)
        tracker.finish(ok=rec["status"] == "ok")


def fill_null_reasons(rec: dict, default: str) -> None:
    """Give every null measurement a reason; reasons already there stay."""
    for k in FIELDS[FIELDS.index("tokens_per_s"):]:
        if rec.get(k) is None and k not in rec["null_reasons"]:
            rec["null_reasons"][k] = default
