"""Mixture-of-Experts FFN: a top-k router, routed and shared SwiGLU experts, and the dispatch.

Dispatch sorts every (token, choice) pair by expert, runs each expert on its contiguous
slice and gathers the outputs back to (token, choice) order, summed with the routing
weights. Kernels: grouped, one grouped matmul per weight; padded, one bmm over groups padded
to the largest; loop, a matmul per expert. No token is dropped unless capacity_factor is set.
Every row move is a gather whose backward is a gather too: scatter-add is slow on CPU.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .capacity import capacity, drop_over_capacity

_grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def _mm_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype autocast would give a matmul on x; grouped_mm has no autocast rule."""
    dev = x.device.type
    if dev != "meta" and torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return x.dtype


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """One matmul per expert in a single call: each group of rows times its expert's weight.

    x (N, K) rows grouped by expert, w (E, K, M), offs (E,) int32 group ends.
    """
    return _grouped_mm(x, w, offs=offs)


_SUPPORTED: dict = {}


def grouped_mm_supported(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether grouped_mm's forward and backward run on this device and dtype; probed once."""
    if _grouped_mm is None:
        return False
    key = (torch.device(device).type, dtype)
    if key not in _SUPPORTED:
        try:
            # May run inside a model's forward (padded's fallback): with grad on whatever the
            # caller's mode, its saved tensors kept as they are (not by an activation
            # checkpoint's hooks). No torch.randn: the global RNG must not move.
            with torch.inference_mode(False), torch.enable_grad(), \
                    torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                x = torch.ones(24, 16, device=device, dtype=dtype, requires_grad=True)
                w = torch.ones(2, 16, 16, device=device, dtype=dtype, requires_grad=True)
                offs = torch.tensor([8, 24], device=device, dtype=torch.int32)
                y = grouped_mm(x, w, offs)
                (gx,) = torch.autograd.grad(y, x, torch.ones_like(y))
            _SUPPORTED[key] = bool(torch.isfinite(gx).all())
        except Exception:  # noqa: BLE001 - any failure means "not supported here"
            _SUPPORTED[key] = False
    return _SUPPORTED[key]


def grouped_aligned(dtype: torch.dtype, *sizes: int) -> bool:
    """Whether grouped_mm can take matrices with rows of these sizes.

    It needs 16-byte-aligned strides: the hidden and ffn sizes must be multiples of 16 bytes,
    that is of 4 fp32 or 8 bf16 values.
    """
    return all(n * dtype.itemsize % 16 == 0 for n in sizes)


def grouped_fast(device: torch.device | str, dtype: torch.dtype,
                 capability: float | None = None) -> bool:
    """Whether grouped_mm has its own kernel on this device and dtype.

    On CUDA only bf16 on sm90/sm100 has one, from CUTLASS. Anything else runs torch's
    fallback: a matmul per expert after copying the group ends to the host, a sync per call,
    9 per MoE layer and step. `capability`: a part's that is not here (a plan's), else the
    device's own.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return True
    major = int(capability) if capability is not None else \
        torch.cuda.get_device_capability(device)[0]
    return dtype == torch.bfloat16 and major in (9, 10)


def grouped_compiles(dtype: torch.dtype) -> bool:
    """grouped_mm lowers under torch.compile in bf16 only."""
    return dtype == torch.bfloat16


def resolve_dispatch(dispatch: str, device: torch.device | str, dtype: torch.dtype,
                     compiled: bool = False, sizes: tuple = ()) -> str:
    """The expert kernel to use for `dispatch` on this device, matmul dtype and mode.

    auto picks by benchmarks/moe-layer.md#why-the-dispatch-is-built-this-way:
    on a GPU, grouped where grouped_mm has its own kernel (grouped_fast), else loop;
    on CPU in bf16, padded, as oneDNN/AMX batched matmuls beat per-expert ones eager and
    compiled, and eager padded falls back on unbalanced routing (PAD_LIMIT);
    on CPU in fp32, grouped eager and loop compiled.
    An explicit grouped becomes loop where grouped_mm cannot run.
    sizes: the experts' hidden and ffn sizes, which grouped_mm needs aligned.
    """
    grouped_ok = ((not compiled or grouped_compiles(dtype)) and grouped_aligned(dtype, *sizes)
                  and grouped_mm_supported(device, dtype))
    if dispatch == "auto":
        if torch.device(device).type == "cpu" and dtype == torch.bfloat16:
            return "padded"
        return "grouped" if grouped_ok and grouped_fast(device, dtype) else "loop"
    if dispatch == "grouped" and not grouped_ok:
        return "loop"
    return dispatch


class _Gather(torch.autograd.Function):
    """rows = x.index_select(0, idx), with a backward that is a gather too.

    Autograd's backward of index_select is an index_add scatter, slow on CPU. back holds, for
    each x row r, the m indices into `rows` it was copied to, so
    grad_x[r] = sum_j grad_rows[back[r, j]]: one gather and a sum. With m = 1, back may be
    1-d, and back[r] = -1 marks a row copied nowhere, whose gradient is 0.
    """

    @staticmethod
    def forward(ctx, x, idx, back):
        ctx.save_for_backward(back)
        ctx.n = x.shape[0]
        return x.index_select(0, idx)

    @staticmethod
    def backward(ctx, g):
        (back,) = ctx.saved_tensors
        if back.dim() == 1:  # m = 1; -1 marks rows nobody copied
            pad = torch.cat([g, g.new_zeros(1, g.shape[1])])
            return pad.index_select(0, torch.where(back < 0, g.shape[0], back)), None, None
        gx = g.index_select(0, back.reshape(-1))
        return sum_middle(gx.view(ctx.n, back.shape[1], g.shape[1])), None, None


def sum_middle(t: torch.Tensor, w: torch.Tensor | None = None) -> torch.Tensor:
    """Sum t (n, m, d) over its middle dim, each slice times w[:, j] if w (n, m) is given.

    m slice adds, not a reduction over the middle dim: on CPU, .sum(1) over a small m is
    several times slower.
    """
    out = None
    for j in range(t.shape[1]):
        tj = t[:, j] if w is None else t[:, j] * w[:, j, None]
        out = tj if out is None else out + tj
    return out


class _WeightedSum(torch.autograd.Function):
    """sum_middle(t, w) with a backward of two broadcast ops.

    Autograd's own backward, through the slices t[:, j], would materialise and fill a zero
    (n, m, d) gradient per slice.
    """

    @staticmethod
    def forward(ctx, t, w):
        ctx.save_for_backward(t, w)
        return sum_middle(t, w)

    @staticmethod
    def backward(ctx, g):
        t, w = ctx.saved_tensors
        gt = g[:, None, :] * w[:, :, None] if ctx.needs_input_grad[0] else None
        gw = (g[:, None, :] * t).sum(-1) if ctx.needs_input_grad[1] else None
        return gt, gw


def weighted_sum(t: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Weighted sum over the middle dim with a cheap backward (_WeightedSum).

    t (n, m, d), w (n, m) -> sum_j t[:, j] * w[:, j, None].
    """
    return _WeightedSum.apply(t, w)


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    """The inverse permutation, inv[order[i]] = i: where each row went. A scatter, no sort."""
    return torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(),
                                                                   device=order.device))


def gather_rows(x: torch.Tensor, idx: torch.Tensor, back: torch.Tensor) -> torch.Tensor:
    """x[idx] for a row map whose inverse `back` is known, with a gather backward (_Gather)."""
    return _Gather.apply(x, idx, back)


class Router(nn.Module):
    """Top-k router: picks each token's experts and the weights of their outputs.

    score_func: softmax over experts, as Mixtral and Qwen3, or each expert's sigmoid, as
    DeepSeek-V3. n_groups > 1 limits each token to its topk_groups best groups of experts,
    a group scored by the sum of its two best experts, as DeepSeek-V3. The chosen experts'
    scores weight their outputs: renormalised to sum 1 if route_norm, times route_scale.
    bias_rate > 0: DeepSeek-V3's auxiliary-loss-free balancing. A per-expert bias,
    `expert_bias`, is added to the scores for the choice only, and update_expert_bias moves
    it after each step; it is a buffer saved with the model, not a parameter.
    routing: learned, its own top-k; balanced or skewed, a set load (set_experts). Either
    way the weights are the router's scores of the chosen experts, so it still learns.
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int,
                 routing: str = "learned", skew: float = 2.0, score_func: str = "softmax",
                 route_norm: bool = True, route_scale: float = 1.0, n_groups: int = 1,
                 topk_groups: int = 1, bias_rate: float = 0.0):
        super().__init__()
        self.top_k = top_k
        self.num_experts = num_experts
        self.routing, self.skew = routing, skew
        self.score_func, self.route_norm, self.route_scale = score_func, route_norm, route_scale
        self.n_groups, self.topk_groups, self.bias_rate = n_groups, topk_groups, bias_rate
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        if bias_rate > 0:
            self.register_buffer("expert_bias", torch.zeros(num_experts))

    def largest(self, tokens: int) -> int | None:
        """The largest expert's count of `tokens` where the routing sets the load, else None."""
        if self.routing == "learned":
            return None
        return set_largest(tokens, self.num_experts, self.top_k,
                           self.skew if self.routing == "skewed" else None)

    def forward(self, x: torch.Tensor):
        """Route x (T, H): returns logits (T, E), probs (T, E), weights (T, k), experts (T, k).

        probs: each token's scores normalised to sum 1, for the balance loss.
        """
        # the gate matmul in autocast's dtype (precision.router_dtype may say fp32);
        # scores, top-k and aux losses in fp32
        logits = self.gate(x).float()
        if self.score_func == "sigmoid":
            scores = logits.sigmoid()
            probs = scores / scores.sum(dim=-1, keepdim=True)
        else:
            scores = probs = logits.softmax(dim=-1)
        if self.routing == "learned":
            experts = self.choose(scores)
        else:
            experts = set_experts(x.shape[0], self.num_experts, self.top_k,
                                  self.skew if self.routing == "skewed" else None, x.device)
        weights = scores.gather(1, experts)
        if self.route_norm:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        if self.route_scale != 1.0:
            weights = weights * self.route_scale
        return logits, probs, weights, experts

    def choose(self, scores: torch.Tensor) -> torch.Tensor:
        """Each token's k experts, (T, k): its top-k scores plus any balancing bias.

        With n_groups > 1, only experts in the token's topk_groups best groups count.
        """
        if self.bias_rate > 0:
            scores = scores + self.expert_bias
        if self.n_groups > 1:
            t, g = scores.shape[0], self.n_groups
            grouped = scores.view(t, g, self.num_experts // g)
            best = grouped.topk(2, dim=-1).values.sum(-1).topk(self.topk_groups, dim=-1).indices
            keep = torch.zeros(t, g, 1, dtype=torch.bool, device=scores.device)
            keep = keep.scatter(1, best[..., None], True)
            scores = grouped.masked_fill(~keep, float("-inf")).view(t, self.num_experts)
        return scores.topk(self.top_k, dim=-1).indices


def seq_balance(probs: torch.Tensor, experts: torch.Tensor, batch: int) -> torch.Tensor:
    """Sequence-wise balance loss: each sequence's Switch loss, averaged over the sequences.

    DeepSeek-V3's L_Bal, Megatron's seq_aux_loss. probs (B*S, E): rows in (sequence,
    position) order; experts (B*S, k): the choices.
    """
    e = probs.shape[1]
    choices = experts.reshape(batch, -1)  # (B, S*k)
    counts = probs.new_zeros(batch, e).scatter_add_(1, choices,
                                                    probs.new_ones(choices.shape))
    frac = counts / choices.shape[1]
    return e * (frac * probs.view(batch, -1, e).mean(dim=1)).sum(dim=1).mean()


@torch.no_grad()
def update_expert_bias(router: Router, counts: torch.Tensor) -> None:
    """Move each expert's balancing bias toward the mean load, after a step.

    counts[e]: the step's tokens sent to expert e. Each bias moves by bias_rate, down if its
    expert is above the mean load and up if below, as DeepSeek-V3. The moves are centred to
    sum 0, as torchtitan's, so the biases keep a mean of 0.
    """
    delta = router.bias_rate * torch.sign(counts.float().mean() - counts.float())
    router.expert_bias += delta - delta.mean()


def set_experts(tokens: int, num_experts: int, top_k: int, skew: float | None,
                device) -> torch.Tensor:
    """Expert choices (tokens, top_k) at a set load, each token's k distinct.

    skew None: balanced, pair i = (token, choice) to expert i mod E, so every expert gets the
    same count to within one, as torchtitan's forced load balance. Otherwise the first
    round(skew * T * k / E) tokens pick expert 0 first and every other pair goes round-robin
    over experts 1..E-1: expert 0 is the busiest, at skew times the mean.
    Needs 1 <= skew <= E / k and k < E.
    """
    pairs = torch.arange(tokens * top_k, device=device)
    if skew is None:
        return pairs.remainder(num_experts).view(tokens, top_k)
    busy = min(tokens, round(skew * tokens * top_k / num_experts))
    first = (pairs // top_k < busy) & (pairs % top_k == 0)  # expert 0's pairs
    rank = (~first).cumsum(0) - 1  # each other pair's place among the others
    return torch.where(first, 0, 1 + rank.remainder(num_experts - 1)).view(tokens, top_k)


def set_largest(tokens: int, num_experts: int, top_k: int, skew: float | None) -> int:
    """The largest expert's count under set_experts' load, from the sizes alone."""
    pairs = tokens * top_k
    if skew is None:
        return -(-pairs // num_experts)
    busy = min(tokens, round(skew * tokens * top_k / num_experts))
    return max(busy, -(-(pairs - busy) // (num_experts - 1)))


class SwiGLU(nn.Module):
    """A dense SwiGLU FFN: w2(silu(w1 x) * w3 x)."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int):
        super().__init__()
        self.w1 = nn.Linear(hidden_size, ffn_hidden_size, bias=False)
        self.w3 = nn.Linear(hidden_size, ffn_hidden_size, bias=False)
        self.w2 = nn.Linear(ffn_hidden_size, hidden_size, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


DISPATCHES = ("grouped", "padded", "loop")
# eager padded falls back when padding would exceed this multiple of the real rows: about
# where, on CPU in bf16, it stops beating grouped (benchmarks/moe-layer.md#unbalanced-routing)
PAD_LIMIT = 1.5
# padded capacity is rounded up to a multiple of this many rows, for fewer distinct matmul
# shapes over a run: on CPU in bf16 each new shape JIT-builds and caches oneDNN kernels,
# costing time and memory (benchmarks/moe-layer.md#padded-capacity-rounded-up)
PAD_MULTIPLE = 16


def pad_capacity(counts: torch.Tensor, rows: int, largest: int | None = None) -> int | None:
    """Rows per expert for padded: the largest group, rounded up to PAD_MULTIPLE.

    None where padded should not run, in eager only: with no rows, which an expert-parallel
    rank can get, or with padding past PAD_LIMIT, where grouped and loop, costing only the
    real rows, do better. Compiled code cannot branch on the counts, so it always pads.
    largest: the largest group where the routing sets it (set_largest), read from no tensor.
    """
    num_experts = counts.shape[0]
    if largest is not None:  # (a set load: inductor folds its counts, and a size read from
        cap = max(largest, 2)  # them was left undefined in the compiled code)
    else:
        # host sync (compiled: a data-dependent size, one symbol, so it can take a hint;
        # >= 2 spares inductor a size-1 case)
        cap = int(counts.max().clamp(min=2))
        torch._check(cap >= 2)
        hint_size(cap)
    if not torch.compiler.is_compiling() and (
            rows == 0 or num_experts * cap > PAD_LIMIT * rows + 16 * num_experts):
        return None
    return (cap + PAD_MULTIPLE - 1) // PAD_MULTIPLE * PAD_MULTIPLE


# inductor's own guess for a data-dependent size (torch._inductor.config.unbacked_symint_fallback)
SIZE_HINT = 8192


def hint_size(n) -> None:
    """Under torch.compile, give a data-dependent size n an explicit guess, SIZE_HINT.

    Inductor counts buffers of an unhinted size as 0 bytes, so it fuses none of their loops
    (benchmarks/moe-layer.md#size-hints-for-compiled-code). Eager: nothing. Compiled, only
    where .item() and .tolist() are traced, as train.compile sets capture_scalar_outputs:
    there n is always a fresh unbacked symbol; otherwise they break the graph and n may be a
    plain or backed size, which takes no hint. Nothing either on a torch without
    override_optimization_hint, such as 2.11.
    """
    if not torch.compiler.is_compiling():
        return
    override = getattr(torch._dynamo, "override_optimization_hint", None)
    if override is not None and torch._dynamo.config.capture_scalar_outputs:
        override(n, SIZE_HINT)


def pad_slots(expert: torch.Tensor, pos: torch.Tensor, counts: torch.Tensor,
              cap: int) -> torch.Tensor:
    """Each row's padded slot: expert * cap + its rank within its expert.

    expert: each row's expert; pos: its place in the expert-sorted order.
    """
    return expert * cap + pos - (counts.cumsum(0) - counts)[expert]


def unpadded_mode(x: torch.Tensor, w: torch.Tensor) -> str:
    """The kernel padded falls back to: grouped where grouped_mm runs, else loop.

    x: the rows; w: an expert weight stack (E, H, F).
    """
    dt = _mm_dtype(x)
    ok = grouped_aligned(dt, *w.shape[1:]) and grouped_mm_supported(x.device, dt)
    return "grouped" if ok else "loop"


class Experts(nn.Module):
    """The routed experts: num_experts SwiGLU FFNs held as stacked weights (E, in, out).

    forward(x, counts, grouped): x (N, H) rows sorted by expert, counts (E,) rows per expert.
    `grouped` picks the kernel: True or "grouped", grouped_mm; "padded", a bmm over groups
    padded to the largest count; False or "loop", a matmul per expert.
    padded(x, slot, cap, fan) runs the padded kernel on rows in any order.
    """

    def __init__(self, num_experts: int, hidden_size: int, ffn_hidden_size: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_size, ffn_hidden_size))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_size, ffn_hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, ffn_hidden_size, hidden_size))

    def forward(self, x: torch.Tensor, counts: torch.Tensor, grouped: bool | str) -> torch.Tensor:
        mode = "grouped" if grouped is True else "loop" if grouped is False else grouped
        if mode == "padded":
            n = x.shape[0]
            cap = pad_capacity(counts, n)
            if cap is not None:
                expert = torch.repeat_interleave(
                    torch.arange(counts.shape[0], device=x.device), counts, output_size=n)
                rows = torch.arange(n, device=x.device)
                return self.padded(x, pad_slots(expert, rows, counts, cap), cap)
            mode = unpadded_mode(x, self.w1)
        if mode == "grouped" and x.shape[0] == 0 and not torch.compiler.is_compiling():
            mode = "loop"  # grouped_mm rejects an empty input (an expert-parallel rank may
            # receive no rows)
        if mode == "grouped":
            dt = _mm_dtype(x)
            x = x.to(dt)
            offs = counts.cumsum(0).to(torch.int32)
            w1, w3, w2 = (w.to(dt) for w in (self.w1, self.w3, self.w2))
            h = F.silu(grouped_mm(x, w1, offs)) * grouped_mm(x, w3, offs)
            return grouped_mm(h, w2, offs)
        sizes = counts.tolist()
        for n in sizes:  # tells torch.compile these data-dependent sizes are valid
            torch._check(n >= 0)
            hint_size(n)
        torch._check(sum(sizes) == x.shape[0])
        # unbind, not w[e]: each w[e]'s backward would materialise a zero gradient of the
        # whole (E, in, out) stack; unbind's backward is one stack.
        w1, w3, w2 = self.w1.unbind(0), self.w3.unbind(0), self.w2.unbind(0)
        outs = []
        for e, xe in enumerate(torch.split(x, sizes)):
            h = F.silu(xe @ w1[e]) * (xe @ w3[e])
            outs.append(h @ w2[e])
        return torch.cat(outs)

    def padded(self, x: torch.Tensor, slot: torch.Tensor, cap: int, fan: int = 1,
               dropped: bool = False) -> torch.Tensor:
        """The padded kernel: every expert's rows padded to `cap`, three batched matmuls.

        x (R, H); slot (R * fan,): output row i's padded row, from pad_slots; its input is
        x row i // fan. Returns (R * fan, H), with one gather in and one out. Padding rows
        read row 0, as any finite row would do: their outputs are dropped, so their gradients
        are zero and add nothing to the weight gradients. dropped: slot E * cap marks output
        rows no expert computes, being over capacity; they read a row of zeros.
        """
        num_experts = self.w1.shape[0]
        rows = num_experts * cap + dropped  # (+ the dropped rows' slot)
        out = torch.arange(slot.shape[0], device=x.device)
        src = slot.new_zeros(rows).scatter_(0, slot, out // fan)
        owner = slot.new_full((rows,), -1).scatter_(0, slot, out)
        dt = _mm_dtype(x)
        xp = gather_rows(x.to(dt), src, slot.view(-1, fan))[:num_experts * cap]
        xp = xp.view(num_experts, cap, -1)
        w1, w3, w2 = (w.to(dt) for w in (self.w1, self.w3, self.w2))
        h = F.silu(torch.bmm(xp, w1)) * torch.bmm(xp, w3)
        y = torch.bmm(h, w2).view(num_experts * cap, -1)
        if dropped:
            y = torch.cat([y, y.new_zeros(1, y.shape[1])])
        return gather_rows(y, slot, owner)


class MoE(nn.Module):
    """Top-k MoE FFN: routed experts plus optional always-on shared experts.

    Dropless unless capacity_factor is set (capacity.py); pad_to_capacity then pads every
    expert to its capacity, for one bmm per weight and static shapes. shared_ffn: the ffn
    size of one shared SwiGLU, as DeepSeek's; 0 for none. router: Router's options.
    forward returns (output, balance loss, sequence balance loss, z-loss, counts, chosen):
    the sequence loss is 0 unless seq_aux; counts are the tokens each expert computed,
    chosen those the router sent it before any drop.
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, num_experts: int, top_k: int,
                 dispatch: str = "loop", routing: str = "learned", skew: float = 2.0,
                 shared_ffn: int = 0, capacity_factor: float | None = None,
                 drop_policy: str = "score", pad_to_capacity: bool = False,
                 seq_aux: bool = False, **router):
        super().__init__()
        if dispatch == "auto":  # unresolved (see resolve_dispatch): the portable choice
            dispatch = "loop"
        if dispatch not in DISPATCHES:
            raise ValueError(f"dispatch must be one of {DISPATCHES} or auto, got {dispatch!r}")
        self.num_experts = num_experts
        self.top_k = top_k
        self.dispatch = dispatch
        # eager padded calls, and those that fell back (unbalanced routing): for the record
        self.padded_calls = self.padded_fallbacks = 0
        self.grouped = dispatch == "grouped"
        self.router = Router(hidden_size, num_experts, top_k, routing, skew, **router)
        self.experts = Experts(num_experts, hidden_size, ffn_hidden_size)
        self.shared_experts = SwiGLU(hidden_size, shared_ffn) if shared_ffn else None
        self.capacity_factor, self.drop_policy = capacity_factor, drop_policy
        self.pad_to_capacity, self.seq_aux = pad_to_capacity, seq_aux

    def forward(self, x: torch.Tensor):
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (T, H)
        logits, probs, weights, experts = self.router(x)
        if self.capacity_factor is not None:
            y, counts, chosen = self._with_capacity(x, weights, experts)
        else:
            y, counts = self._dropless(x, experts)
            chosen = counts
        # The routing-weighted sum over the k choices.
        out = weighted_sum(y.view(x.shape[0], self.top_k, y.shape[-1]), weights.to(y.dtype))
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        if x.shape[0] == 0:  # no tokens, no aux losses (their means over none would be nan)
            zero = logits.sum()
            return out.reshape(shape), zero, zero, zero, counts, chosen
        # Switch load-balancing loss: E * sum_e (fraction of choices of e) * (mean prob of e)
        frac = chosen.to(probs.dtype) / experts.numel()
        balance = self.num_experts * (frac * probs.mean(dim=0)).sum()
        seq = (seq_balance(probs, experts, shape[0] if len(shape) == 3 else 1)
               if self.seq_aux else logits.new_zeros(()))
        z = torch.logsumexp(logits, dim=-1).square().mean()
        return out.reshape(shape), balance, seq, z, counts, chosen

    def _with_capacity(self, x, weights, experts):
        """Run the experts with capacity drops; returns outputs, kept and chosen counts.

        Outputs are (T*k, H) in (token, choice) order, zero where dropped.
        """
        n, k, e = experts.numel(), self.top_k, self.num_experts
        cap = capacity(x.shape[0], k, e, self.capacity_factor)
        flat, chosen = drop_over_capacity(experts, weights, e, cap, self.drop_policy)
        order = torch.argsort(flat, stable=True)  # kept by expert, then the dropped
        inv = inverse_permutation(order)
        every = flat.new_zeros(e + 1).scatter_add_(0, flat, torch.ones_like(flat))
        counts = every[:e]
        if self.pad_to_capacity and isinstance(self.experts, Experts) and x.shape[0]:
            slot = torch.where(flat < e, pad_slots(flat.clamp(max=e - 1), inv, every, cap),
                               e * cap)
            return self.experts.padded(x, slot, cap, k, dropped=True), counts, chosen
        kept = int(counts.sum())  # host sync (compiled: a data-dependent size)
        torch._check(kept <= n)
        hint_size(kept)
        mode = self.grouped if self.dispatch != "padded" else "padded"
        xs = gather_rows(x.to(_mm_dtype(x)), order // k, inv.view(-1, k))
        y = self.experts(xs[:kept], counts, mode)
        y = torch.cat([y, y.new_zeros(n - kept, y.shape[1])])
        return gather_rows(y, inv, order[:, None]), counts, chosen

    def _dropless(self, x, experts):
        """Run the experts on every (token, choice) pair; returns outputs and counts.

        Outputs are (T*k, H) in (token, choice) order; counts are rows per expert.
        """
        flat = experts.reshape(-1)  # (T*k,) in (token, choice) order
        order = torch.argsort(flat, stable=True)
        # static-shape histogram (bincount's output size is data-dependent under compile)
        counts = flat.new_zeros(self.num_experts).scatter_add_(0, flat, torch.ones_like(flat))
        # inv[i]: where pair i = (token, choice) sits in the sorted order
        inv = inverse_permutation(order)
        y = None
        mode = self.grouped if self.dispatch != "padded" else "padded"
        if mode == "padded" and isinstance(self.experts, Experts):  # (expert parallel's
            # wrapper takes expert-sorted rows)
            cap = pad_capacity(counts, flat.numel(), self.router.largest(x.shape[0]))
            if cap is not None:  # tokens straight to their padded rows and back
                y = self.experts.padded(x, pad_slots(flat, inv, counts, cap), cap, self.top_k)
            else:
                mode = unpadded_mode(x, self.experts.w1)
            if not torch.compiler.is_compiling():  # (compiled code always pads)
                self.padded_calls += 1
                self.padded_fallbacks += cap is None
        if y is None:
            # Gathers whose backward is a gather too (no scatter): token rows sorted by
            # expert (cast first: the matmuls' dtype, half the bytes to move under bf16).
            xs = gather_rows(x.to(_mm_dtype(x)), order // self.top_k, inv.view(-1, self.top_k))
            y = self.experts(xs, counts, mode)
            y = gather_rows(y, inv, order[:, None])  # back to (token, choice) order
        return y, counts
