"""Row moves of the MoE dispatch, forward + backward: autograd's indexing vs `gather_rows`.

    PYTHONPATH=. python benchmarks/row_moves.py [--shapes tiny,small,1b] [--dtypes fp32,bf16]
        [--reps 30] [--json out.json]

Two moves, each there and back, on rows like the MoE layer's (tokens x top_k rows of width
hidden), same indices and gradient for both contenders (their gradients are checked equal):
- fan-out: each token to its top_k rows in expert order and the rows back to (token,
  choice) order, as `MoE.forward` does; `index` = `x.index_select` / `y.index_select`
  (backward: a scatter-add each), `gather` = `moe.gather_rows` (backward: a gather, and a
  sum over the k copies);
- permute: rows regrouped by local expert and back, as expert parallelism's wrapper does
  with the rows it receives; `index` = `x[order]` / `index_copy` (backward: an accumulating
  index_put, and a gather), `gather` = `gather_rows` both ways.
"""
from __future__ import annotations

import argparse
import datetime as dt
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import (add_device, at_least, device_name, one_of, out_file,  # noqa: E402
                     run_rounds, save_json)

from moe_exp.bench.timer import device_sync  # noqa: E402
from moe_exp.model.moe import gather_rows, inverse_permutation  # noqa: E402

# tokens x hidden x experts x top_k, as moe_layer.py's shapes
SHAPES = {"tiny": (1024, 128, 8, 2), "small": (2048, 256, 16, 2), "1b": (2048, 1024, 16, 2)}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def contenders(shape, dtype, device):
    """{move: {contender: fn}}, each fn a forward + backward from fresh leaves."""
    tokens, hidden, experts, k = shape
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=g).to(device, dtype).requires_grad_()
    pair_expert = torch.randint(0, experts, (tokens * k,), generator=g).to(device)
    order = torch.argsort(pair_expert, stable=True)  # pairs in expert order
    inv = inverse_permutation(order)
    grad = torch.randn(tokens * k, hidden, generator=g).to(device, dtype)
    rows = torch.randn(tokens * k, hidden, generator=g).to(device, dtype).requires_grad_()

    def fan_index():
        y = x.index_select(0, order // k) * 2  # (the experts' work, elided)
        y.index_select(0, inv).backward(grad)

    def fan_gather():
        y = gather_rows(x, order // k, inv.view(-1, k)) * 2
        gather_rows(y, inv, order[:, None]).backward(grad)

    def perm_index():
        y = rows[order] * 2
        torch.empty_like(y).index_copy(0, order, y).backward(grad)

    def perm_gather():
        y = gather_rows(rows, order, inv) * 2
        gather_rows(y, inv, order).backward(grad)

    moves = {"fan-out": (x, {"index": fan_index, "gather": fan_gather}),
             "permute": (rows, {"index": perm_index, "gather": perm_gather})}
    for leaf, fns in moves.values():  # same gradients, or the comparison means nothing
        grads = []
        for fn in fns.values():
            leaf.grad = None
            fn()
            grads.append(leaf.grad)
        torch.testing.assert_close(grads[0], grads[1])
    return {m: fns for m, (_, fns) in moves.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_device(ap)
    ap.add_argument("--shapes", default="tiny,small,1b", type=one_of(SHAPES))
    ap.add_argument("--dtypes", default="fp32,bf16", type=one_of(DTYPES))
    ap.add_argument("--reps", type=at_least(1), default=30)
    ap.add_argument("--warmup", type=at_least(0), default=3)
    ap.add_argument("--json", default=None, type=out_file)
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    sync = lambda: device_sync(device)  # noqa: E731
    dev_name = device_name(device)
    print(f"# row moves, forward + backward, {dev_name}, torch {torch.__version__}, "
          f"{dt.date.today()}, median of {a.reps}")
    print(f"{'shape':6} {'dtype':5} {'move':8} {'index ms':>9} {'gather ms':>10} {'speedup':>8}")
    rows = []
    for s in a.shapes.split(","):
        for d in a.dtypes.split(","):
            for move, fns in contenders(SHAPES[s], DTYPES[d], device).items():
                r = run_rounds(fns, a.reps, warmup=a.warmup, sync=sync)
                med = r["median_ms"]
                rows.append({"shape": s, "dims": SHAPES[s], "dtype": d, "move": move,
                             "median_ms": med, "speedup": med["index"] / med["gather"],
                             **{k: r[k] for k in ("rounds", "dropped_rounds", "contended",
                                                  "order")}})
                print(f"{s:6} {d:5} {move:8} {med['index']:9.3f} {med['gather']:10.3f} "
                      f"{rows[-1]['speedup']:7.2f}x  [{r['rounds']} rounds, "
                      f"{r['dropped_rounds']} dropped"
                      f"{', CONTENDED' if r['contended'] else ''}]", flush=True)
                if a.json:  # after every row: a run cut short keeps what it measured
                    save_json(a.json, dev_name, rows)
    return rows


if __name__ == "__main__":
    main()
