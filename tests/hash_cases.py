"""The config-hash regression cases: every group option (and +seed_row) composed alone, then
each schema key of it changed to another value, and a few combinations. Run as a script to
record tests/data/config_hashes.json (do so only where a hash is meant to change)."""
from __future__ import annotations

import dataclasses
import json
import sys
import typing
from pathlib import Path

DATA = Path(__file__).parent / "data" / "config_hashes.json"
GROUPS = ("model", "precision", "parallel", "hardware", "data", "optim", "logger", "+seed_row")
# (combinations whose keys interact in the hash: rank keys, prefetch past the layers, muon)
COMBOS = (("parallel=fsdp", "model=small_moe"), ("parallel=expert_fsdp", "optim=muon"),
          ("task=comm", "parallel=ddp"), ("precision=fp8", "parallel=expert"),
          ("data=tokens", "data.path=x.bin"), ("model=tiny_dense", "optim=muon"))


# parallel keys of one option: set under another, 87b7797 refused the run (invalid, nothing
# measured), so those are no cases (since then such a key counts at its default there)
OWN = {("ddp",): {"bucket_cap_mb": 25.0, "gradient_as_bucket_view": True, "static_graph": False},
       ("fsdp", "expert_fsdp"): {"reshard_after_forward": True, "cpu_offload": False,
                                 "prefetch": 0},
       ("expert", "expert_fsdp"): {"expert_parallel_size": None}}


def refused(d: dict) -> bool:
    p = d.get("parallel") or {}
    return any(p.get("name") not in names and p.get(k, v) != v
               for names, keys in OWN.items() for k, v in keys.items())


def bases() -> list[tuple[str, ...]]:
    from moe_exp.config import CONF

    out = [(), ("task=comm",)]
    for g in GROUPS:
        for o in sorted(p.stem for p in (CONF / g.lstrip("+")).glob("*.yaml")):
            out.append((f"{g}={o}",))
    return out + [c for c in COMBOS]


def _alts(value, typ) -> list:
    """Other values of a key: a bool flipped, a number changed, a string's other choices."""
    origin = typing.get_origin(typ)
    args = [a for a in typing.get_args(typ) if a is not type(None)]
    if origin is typing.Union:
        typ = args[0]
    if value is None:
        return [{int: 2, float: 1.5, str: "x"}.get(typ, "x")]
    if isinstance(value, bool):
        return [not value]
    if isinstance(value, int):
        return [value + 1, 0, value + 5]
    if isinstance(value, float):
        return [value * 2 + 1]
    if isinstance(value, str):  # (each group option is a base of its own)
        return ["alt"]
    if isinstance(value, list):
        return [value[:-1] if value else ["fp32"]]
    if isinstance(value, dict):
        return [{**value, "fp32": 1.0}]
    return []


def _fields(schema) -> dict:
    return {f.name: f.type for f in dataclasses.fields(schema)}


def cases(keys=None, choices=None, only=None) -> dict[str, dict[str, str]]:
    """{base: {'key=value' (or '' for the base itself): config_hash}}. keys: the dotted keys
    to vary (those recorded: a key added since is left at its default, which must keep
    every older hash); choices: {key: allowed values} as recorded (config.CHOICES); only:
    the bases to compose (their names; None: all)."""
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    from moe_exp import config as c
    from moe_exp.results import config_hash

    types = typing.get_type_hints(c.RunConfig)
    choices = c.CHOICES if choices is None else choices
    out = {}
    with initialize_config_module(config_module="moe_exp.conf", version_base="1.3"):
        composed = {b: OmegaConf.to_container(compose("run", ["logger=none", *b]), resolve=True)
                    for b in bases() if only is None or (" ".join(b) or "default") in only}
    for base, d in composed.items():
        name = " ".join(base) or "default"
        mine = out[name] = {"": config_hash(d)}
        for group, node in d.items():
            if not isinstance(node, dict):
                continue
            hints = typing.get_type_hints(types[group]) if group in types and \
                dataclasses.is_dataclass(types[group]) else {}
            for key, value in node.items():
                if keys is not None and f"{group}.{key}" not in keys:
                    continue
                allowed = choices.get(f"{group}.{key}")
                alts = [v for v in allowed if v != value] if allowed else \
                    _alts(value, hints.get(key, type(value)))
                for alt in alts:  # (config_hash copies what it changes: no deep copy)
                    v = {**d, group: {**node, key: alt}}
                    if refused(v):
                        continue
                    mine[f"{group}.{key}={json.dumps(alt)}"] = config_hash(v)
    return out


def digest(hashes: dict[str, str]) -> str:
    """One base's cases in 16 hex digits (the file stays small; a mismatch names the base,
    and running this file at the commit before tells which case moved)."""
    import hashlib

    text = "\n".join(f"{k}={v}" for k, v in sorted(hashes.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def recorded() -> dict:
    """{"keys": the keys varied, "bases": {base: its hash, its cases' count and digest}}."""
    return json.loads(DATA.read_text())


def current(keys=None, choices=None, only=None) -> dict:
    from moe_exp.config import CHOICES

    choices = {k: sorted(v) for k, v in (CHOICES if choices is None else choices).items()}
    got = cases(keys, choices, only)
    varied = sorted({k.split("=", 1)[0] for h in got.values() for k in h if k})
    return {"keys": varied, "choices": choices,
            "bases": {base: {"hash": h[""], "cases": len(h), "digest": digest(h)}
                      for base, h in got.items()}}


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    if sys.argv[1:] not in ([], ["--show"]):  # (anything else once re-recorded the file)
        sys.exit("usage: python tests/hash_cases.py [--show]  (no argument: record "
                 f"{DATA.name}; --show: print every case, to diff against another commit's)")
    if sys.argv[1:] == ["--show"]:  # every case, to diff against another commit's
        for base, hashes in cases().items():
            for k, v in sorted(hashes.items()):
                print(f"{base} | {k} {v}")
    else:
        DATA.write_text(json.dumps(current(), indent=1, sort_keys=True) + "\n")
        print(f"{DATA}: {len(recorded()['bases'])} bases")
