"""Memory-mapped token files, `<name>.bin` with a `<name>.bin.json` sidecar, and making one.

`python -m moe_exp.data prepare a.txt b.txt out.bin` writes the files' bytes as tokens:
byte-level, vocabulary 256, no tokenizer, no downloads.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Iterable

import numpy as np
import torch
from torch.utils.data import Dataset


def meta_path(path: str | Path) -> Path:
    return Path(str(path) + ".json")


def read_meta(path: str | Path) -> dict:
    """Read a token file's sidecar and check it against the file.

    Raises a one-line ValueError where the sidecar does not describe the file.
    """
    mp = meta_path(path)
    try:
        meta = json.loads(mp.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{mp} is not a token file's JSON sidecar ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''}); remake it with "
                         "python -m moe_exp.data prepare") from None
    try:
        dtype, n = np.dtype(meta["dtype"]), meta["num_tokens"]
        whole = [isinstance(v, int) and not isinstance(v, bool) for v in (n, meta["vocab_size"])]
        ok = dtype.kind in "ui" and all(whole) and n >= 0 and meta["vocab_size"] > 0
    except (TypeError, KeyError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"{mp} lacks an integer dtype, vocab_size and num_tokens; remake it "
                         "with python -m moe_exp.data prepare")
    st = Path(path).stat()
    if st.st_size != n * dtype.itemsize:
        raise ValueError(f"{path} holds {st.st_size} bytes, but {mp.name} says {n} {dtype.name} "
                         f"tokens ({n * dtype.itemsize} bytes): remake them together with "
                         "python -m moe_exp.data prepare")
    vocab = meta["vocab_size"]
    if n and (dtype.kind == "i" or np.iinfo(dtype).max >= vocab):  # ids the dtype allows
        try:
            lo, hi = _id_range(str(Path(path).resolve()), dtype.str, st.st_size, st.st_mtime_ns)
        except (OSError, ValueError) as e:  # unreadable, or not a file that maps
            raise ValueError(f"{path} cannot be read as tokens ({type(e).__name__}: {e})") \
                from None
        if lo < 0 or hi >= vocab:
            raise ValueError(f"{path} holds token id {lo if lo < 0 else hi}, outside its "
                             f"vocabulary 0..{vocab - 1} ({mp.name}): correct vocab_size there "
                             "(a tokenizer's added tokens count), or remake the file with "
                             "python -m moe_exp.data prepare")
    return meta


@functools.lru_cache(maxsize=8)
def _id_range(path: str, dtype: str, size: int, mtime_ns: int) -> tuple[int, int]:
    """The smallest and largest token id in the file, scanned once per file version."""
    tokens = np.memmap(path, dtype=dtype, mode="r")
    lo, hi = None, None
    for s in range(0, len(tokens), 1 << 26):
        chunk = tokens[s: s + (1 << 26)]
        a, b = int(chunk.min()), int(chunk.max())
        lo, hi = a if lo is None else min(lo, a), b if hi is None else max(hi, b)
    return lo, hi


def path_override(path: str) -> str:
    """data.path=PATH as a shell word Hydra reads back as the string PATH."""
    from ..config import override_word

    return override_word("data.path", path)


def prepare(inputs: Iterable[str | Path], out: str | Path) -> dict:
    """Concatenate the inputs' bytes, each followed by a 0 separator, into a uint8 token file."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with open(out, "wb") as f:
        for p in inputs:
            data = Path(p).read_bytes()
            f.write(data + b"\0")
            n += len(data) + 1
    meta = {"dtype": "uint8", "vocab_size": 256, "num_tokens": n, "tokenizer": "bytes",
            "sources": [str(p) for p in inputs]}
    meta_path(out).write_text(json.dumps(meta, indent=2))
    return meta


class TokenFile(Dataset):
    """Windows of seq_len+1 tokens at seeded random offsets into a memory-mapped file."""

    def __init__(self, path: str | Path, seq_len: int, num_samples: int, seed: int = 0,
                 hold: int = 0):
        meta = read_meta(path)
        self.tokens = np.memmap(path, dtype=meta["dtype"], mode="r")
        self.seq_len = seq_len
        high = len(self.tokens) - hold - seq_len  # window starts 0..high-1 (hold: the
        # file's last tokens, the held-out set's, in no window)
        if high <= 0:
            raise ValueError(f"data.path: {path} holds {len(self.tokens)} tokens, "
                             f"fewer than train.seq_len+1={seq_len + 1}")
        g = torch.Generator().manual_seed(seed)
        self.starts = torch.randint(0, high, (num_samples,), generator=g).tolist()

    def tail(self, n: int) -> torch.Tensor:
        """The held-out set: the file's last n whole windows of seq_len+1 tokens, in order."""
        w = self.seq_len + 1
        rows = self.tokens[len(self.tokens) - n * w:].astype(np.int64)
        return torch.from_numpy(rows).view(n, w)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int):
        s = self.starts[i]
        row = torch.from_numpy(self.tokens[s: s + self.seq_len + 1].astype(np.int64))
        return row[:-1], row[1:]


def held_tokens(cfg) -> int:
    """data=tokens with data.heldout: how many of the file's last tokens training leaves out."""
    d, t = cfg.data, cfg.train
    return t.eval_sequences * (t.seq_len + 1) if d.source == "tokens" and d.heldout else 0


def check_token_file(cfg) -> None:
    """Check, before any work, that data=tokens has a usable token file at data.path.

    It needs its sidecar, a vocabulary that fits the model and at least one sequence;
    raises ConfigError otherwise.
    """
    from omegaconf import OmegaConf

    from ..config import ConfigError

    d = cfg.data
    make = "python -m moe_exp.data prepare <text files> <out.bin>"
    if OmegaConf.is_missing(d, "path") or not d.path:
        raise ConfigError("data.path", f"data=tokens needs data.path=<token file>; make one "
                          f"with {make}")
    if not Path(d.path).is_file():
        raise ConfigError("data.path", f"no token file at '{d.path}'; make one with {make}")
    if not meta_path(d.path).is_file():
        raise ConfigError("data.path", f"'{d.path}' has no {meta_path(d.path).name} beside "
                          "it; make token files with python -m moe_exp.data prepare")
    try:
        meta = read_meta(d.path)
    except ValueError as e:
        raise ConfigError("data.path", str(e)) from None
    vocab = meta["vocab_size"]
    if vocab > cfg.model.vocab_size:
        raise ConfigError("model.vocab_size", f"{cfg.model.vocab_size} is smaller than the "
                          f"token file's vocabulary ({vocab})")
    if meta.get("num_tokens", cfg.train.seq_len + 1) < cfg.train.seq_len + 1:
        raise ConfigError("data.path", f"'{d.path}' holds {meta['num_tokens']} tokens, fewer "
                          f"than train.seq_len+1={cfg.train.seq_len + 1}")
    if (hold := held_tokens(cfg)) and meta["num_tokens"] < hold + cfg.train.seq_len + 1:
        raise ConfigError("data.heldout", f"'{d.path}' holds {meta['num_tokens']} tokens: "
                          f"holding out train.eval_sequences={cfg.train.eval_sequences} x "
                          f"{cfg.train.seq_len + 1} leaves less than one training window "
                          "(fewer train.eval_sequences, or a larger file)")
