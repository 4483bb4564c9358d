"""A compiled step's memory, planned from what torch's compile keeps rather than the eager
step's.

The model's forward and backward are traced as AOTAutograd's joint graph and split by the
min-cut partitioner inductor uses, on inductor's decompositions: the forward saves what
that partition saves for the backward. Each graph then runs on the fake tensors with
inductor's fusion: a pointwise op whose users are all pointwise ops, views or reductions is
fused into them and writes no buffer (its output is not tracked); a cat's inputs read by it
alone write into its buffer, held from the first; every other op's output is a buffer.
What reads the graph's inputs alone runs first, as inductor's scheduler puts it; inputs
and values are freed after their last use, as inductor's code frees them. The partitions
are the run's (the same saved tensors; inductor's code for each holds the same buffers);
a pointwise op read by several ops is inlined into each unless inductor keeps it (on a CPU,
one that computes an exp, log, sigmoid or tanh; one that reads more than
realize_reads_threshold buffers)."""
from __future__ import annotations

import contextlib
import operator
from functools import partial

import torch
from torch import nn

RNG = torch.ops.higher_order
# reads inductor lowers as loops with an indirect load, fused as pointwise ops are
INDEXING = {"gather", "index", "index_select", "embedding", "where"}
# tensors of one value or a range: loops with no load
FILLS = {"full", "full_like", "zeros", "zeros_like", "ones", "ones_like", "scalar_tensor",
         "iota", "arange"}
FULL = {torch.ops.aten.full.default, torch.ops.aten.zeros.default,
        torch.ops.aten.full_like.default, torch.ops.aten.zeros_like.default}
# reductions inductor fuses their pointwise inputs into
REDUCTIONS = {"sum", "mean", "amax", "amin", "max", "min", "prod", "var_mean", "var",
              "argmax", "argmin", "any", "all", "logsumexp"}
# ops whose result a CPU's inductor stores when several ops read it rather than compute it
# again in each (StorageBox.should_realize_on_reuse's heavy ops; silu: x * sigmoid(x))
HEAVY = {"exp", "log", "log10", "log1p", "log2", "sigmoid", "tanh", "silu", "silu_backward",
         "logsumexp"}


def partitioned(cfg) -> bool:
    """Whether a plan's memory is the compiled step's (train.compile on one device). Under
    a parallel strategy a compiled step's memory is the eager step's: its hooks and
    collectives run between compiled graphs."""
    return cfg.train.compile != "off" and cfg.parallel.name == "none"


def memory_basis(cfg) -> str:
    """What a plan's memory is traced from (the record's planned_memory_basis)."""
    if partitioned(cfg):
        return "compiled step (AOTAutograd's min-cut partition, inductor's fusion)"
    if cfg.train.compile == "off":
        return "eager step"
    return f"eager step (a compiled step's under parallel={cfg.parallel.name} is not " \
           "planned yet)"


class Compiled(nn.Module):
    """`model` as torch.compile runs it in a plan: its forward and backward the partitioned
    graphs. The first call traces them (outside the memory tracker: its module hooks do not
    follow a trace); later calls run them.

    Checkpointed blocks (`ac`: full or selective) are traced unwrapped, their ops tagged as
    dynamo tags a checkpoint's: full, each recomputed in the backward; selective, the
    policy's saved ops saved and the rest recomputed where the partitioner prefers."""

    def __init__(self, model: nn.Module, ac: str = "none", cpu: bool = True):
        super().__init__()
        from functorch.compile import aot_function
        from torch._inductor.decomposition import select_decomp_table

        self.inner = model
        _unwrap_checkpoints(model)

        def call(params, buffers, *args):
            return torch.func.functional_call(model, {**params, **buffers}, args)

        fused = partial(_fused, cpu=cpu)
        self._fn = aot_function(call, fw_compiler=fused, bw_compiler=fused,
                                partition_fn=partial(_partition, ac=ac),
                                decompositions=select_decomp_table())

    def forward(self, *args):
        return self._fn(dict(self.inner.named_parameters()),
                        dict(self.inner.named_buffers()), *args)


def _unwrap_checkpoints(model: nn.Module) -> None:
    """Each checkpoint-wrapped block replaced by the block, whose forward ops are marked
    with the block's number (node.meta["ac_graph_id"], which the trace copies from
    fx.traceback's current meta)."""
    import torch.fx.traceback as fx_traceback
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    from ..model.transformer import block_items

    def enter(i):
        def hook(*_):
            fx_traceback.current_meta["ac_graph_id"] = i
        return hook

    def leave(*_):
        fx_traceback.current_meta.pop("ac_graph_id", None)

    for i, (key, block) in enumerate(block_items(getattr(model, "layers", []))):
        if isinstance(block, CheckpointWrapper):
            block = model.layers[key] = block._checkpoint_wrapped_module
            block.register_forward_pre_hook(enter(i + 1))
            block.register_forward_hook(leave)


def _partition(joint, inputs, ac: str, **kwargs):
    """inductor's min-cut partition of the joint graph, a checkpointed block's forward ops
    tagged first as dynamo tags them (CheckpointPolicy)."""
    from functorch.compile import min_cut_rematerialization_partition
    from torch.utils.checkpoint import CheckpointPolicy

    from ..optimizations.checkpointing import SAVE_OPS

    for n in joint.graph.nodes:
        if n.meta.get("ac_graph_id") is None or n.meta.get("partitioner_tag") == "is_backward":
            continue
        op = n.args[0].target if n.target is operator.getitem else n.target  # (an output
        saved = ac == "selective" and op in SAVE_OPS  # of a tuple: its op's)
        n.meta["recompute"] = CheckpointPolicy.MUST_SAVE if saved else \
            CheckpointPolicy.PREFER_RECOMPUTE if ac == "selective" else \
            CheckpointPolicy.MUST_RECOMPUTE
    return min_cut_rematerialization_partition(joint, inputs, **kwargs)


def _kind(node) -> str:
    t = node.target
    if node.op != "call_function":
        return node.op
    if t is operator.getitem:
        return "view"
    if not isinstance(t, torch._ops.OpOverload):
        return "extern"
    name = t.overloadpacket.__name__
    if torch.Tag.pointwise in t.tags or name in INDEXING or name in FILLS or (
            name == "scatter" and getattr(node.args[0], "target", None) in FULL):
        return "pointwise"  # (a scatter onto a constant: inductor's where(iota == index))
    if t.is_view:
        return "view"
    if name in REDUCTIONS:
        return "reduction"
    return "extern"


def fused_nodes(gm, cpu: bool = True) -> set:
    """The pointwise nodes inductor fuses into their users: each user (through views) a
    pointwise op or a reduction, none the graph's output; and one read by several nodes
    only where inductor does not store it (kept: on a CPU, one whose inlined ops compute a
    HEAVY one; one reading more than realize_reads_threshold buffers)."""
    from torch._inductor import config

    def consumers(node):
        for u in node.users:
            if _kind(u) == "view":
                yield from consumers(u)
            else:
                yield u

    fused, heavy, reads = set(), set(), {}
    for n in gm.graph.nodes:
        if _kind(n) != "pointwise":
            continue
        inlined = [a for a in n.all_input_nodes if a in fused]
        if _name(n) in HEAVY or any(a in heavy for a in inlined):
            heavy.add(n)
        reads[n] = set().union(*(reads[a] if a in fused else {a} for a in n.all_input_nodes))
        kept = len(n.users) > 1 and (cpu and n in heavy or
                                     len(reads[n]) > config.realize_reads_threshold)
        if not kept and all(_kind(u) in ("pointwise", "reduction") for u in consumers(n)):
            fused.add(n)
    return fused


def _name(node) -> str:
    t = node.target
    return t.overloadpacket.__name__ if isinstance(t, torch._ops.OpOverload) else ""


def hoist_input_only(gm) -> None:
    """Moves the pointwise ops, views and reductions that read the graph's inputs alone
    to its start, as inductor's scheduler runs them there (a backward's recompute of
    checkpointed activations: one kernel at the start, its buffers held until read)."""
    early, anchor = set(), None
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            anchor = n
        elif _kind(n) in ("pointwise", "view", "reduction") and all(
                a.op == "placeholder" or a in early for a in n.all_input_nodes):
            early.add(n)
    for n in [n for n in gm.graph.nodes if n in early]:
        if anchor is not None:
            anchor.append(n)
            anchor = n


def written_into_cats(gm) -> tuple[dict, set]:
    """The cat inputs inductor writes in place: each an op's only output, read by the cat
    alone (through views). Inductor allocates such a cat's buffer at its first such
    input's kernel and has each write into its slice (the loop dispatch's experts: their
    outputs and gradients); other inputs are copied in. ({first such op: its cat}, every
    such op)."""
    def source(a):
        while _kind(a) == "view" and a.target is not operator.getitem and len(a.users) == 1:
            a = a.args[0]
        return a

    first, into = {}, set()
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for n in gm.graph.nodes:
        if n.target is not torch.ops.aten.cat.default:
            continue
        ops = [source(a) for a in n.args[0]]
        ops = [o for o in ops if ops.count(o) == 1 and o.op == "call_function" and
               _kind(o) in ("extern", "pointwise") and len(o.users) == 1 and
               isinstance(o.meta.get("val"), torch.Tensor)]
        if ops:
            first[min(ops, key=order.get)] = n
            into.update(ops)
    return first, into


def _fused(gm, _example_inputs, cpu: bool = True):
    """A compiler of AOTAutograd's (boxed): runs `gm` with fusion's buffers only."""
    hoist_input_only(gm)
    fused = fused_nodes(gm, cpu)
    first, into = written_into_cats(gm)
    held = {}  # a cat's buffer, from its first input's kernel

    class Run(torch.fx.Interpreter):
        def call_function(self, target, args, kwargs):
            if target is RNG.run_and_save_rng_state:  # (a recomputed random op: its
                return torch.empty(0, dtype=torch.uint8), args[0](*args[1:], **kwargs)
            if target is RNG.run_with_rng_state:  # generator's state, then the op)
                return args[1](*args[2:], **kwargs)
            return super().call_function(target, args, kwargs)

        def run_node(self, n):
            if n in first:
                v = first[n].meta["val"]
                held[first[n]] = v.new_empty_strided(v.shape, v.stride())
            held.pop(n, None)  # (the cat: its buffer becomes its output, tracked)
            if n not in fused and n not in into:
                return super().run_node(n)
            with _untracked():
                return super().run_node(n)

    def run(args):
        return Run(gm, garbage_collect_values=True).boxed_run(args)

    run._boxed_call = True
    return run


@contextlib.contextmanager
def _untracked():
    """The active plan tracker (plan/tracker.py) does not see the ops run inside."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    trackers = [m for m in _get_current_dispatch_mode_stack() if hasattr(m, "hidden")]
    for t in trackers:
        t.hidden = True
    try:
        yield
    finally:
        for t in trackers:
            t.hidden = False
