"""Reads W&B offline run files for the tests: what a run logged, as W&B stored it."""
from __future__ import annotations

import json
from pathlib import Path


def read_offline_run(run_file: str | Path, wait_s: float = 30.0) -> dict:
    """read_run once the file holds the run's exit record: W&B's service process writes the
    file, and on a loaded machine its last records can land after run.finish() has
    returned (a CI run read exit_code None once); after wait_s, what it holds."""
    import time

    end = time.monotonic() + wait_s
    while True:
        try:
            out = read_run(run_file)
        except Exception:  # noqa: BLE001 - a record cut mid-write: read again
            if time.monotonic() > end:
                raise
            out = None
        if out is not None and (out["exit_code"] is not None or time.monotonic() > end):
            return out
        time.sleep(0.2)


def read_run(run_file: str | Path) -> dict:
    """Parse an offline `run-*.wandb` file (a 7-byte W&B header, then a LevelDB-log stream of
    protobuf Records) into {config, summary, history, exit_code, group, start_time (epoch s)}.
    wandb 0.31 has no Python reader of these (its reading lives in its Go core)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(run_file).read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{run_file} is not a W&B run file")
    block, pos, buf, payloads = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # block trailer padding
            pos += block - pos % block
            continue
        length = int.from_bytes(data[pos + 4: pos + 6], "little")
        kind = data[pos + 6]
        chunk = data[pos + 7: pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        buf = chunk if kind in (1, 2) else buf + chunk  # FULL/FIRST start, MIDDLE/LAST append
        if kind in (1, 4):
            payloads.append(buf)
    out = {"config": {}, "summary": {}, "history": [], "exit_code": None, "group": None,
           "start_time": None}
    for payload in payloads:
        rec = pb.Record()
        rec.ParseFromString(payload)
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            out["group"] = rec.run.run_group or out["group"]
            if rec.run.HasField("start_time"):
                out["start_time"] = rec.run.start_time.ToMicroseconds() / 1e6
        if kind in ("config", "run"):
            items = rec.config.update if kind == "config" else rec.run.config.update
            for item in items:
                out["config"][item.key] = json.loads(item.value_json)
        elif kind == "summary":
            for item in rec.summary.update:
                out["summary"][item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
        elif kind == "history":
            out["history"].append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json)
                                   for i in rec.history.item})
        elif kind == "exit":
            out["exit_code"] = rec.exit.exit_code
    return out
