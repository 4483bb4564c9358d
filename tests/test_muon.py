"""optim=muon: the update is torch.optim.Muon's, per matrix and per expert."""
import copy

import pytest
import torch

from conftest import compose, run_inproc


def _steps(opt, params, grads):
    for g in grads:
        for p, gp in zip(params, g):
            p.grad = gp.clone()
        opt.step()


@pytest.mark.parametrize("nesterov", [True, False])
def test_update_equals_torch_muon_per_matrix_and_per_expert(nesterov):
    """A 2-D weight, and an (E, in, out) expert stack whose experts are orthogonalized one
    by one: three steps give torch.optim.Muon's ("match_rms_adamw") weights."""
    from moe_exp.optim.muon import Muon

    g = torch.Generator().manual_seed(0)
    mat, stack = torch.randn(48, 32, generator=g), torch.randn(4, 32, 80, generator=g)
    grads = [(torch.randn(48, 32, generator=g), torch.randn(4, 32, 80, generator=g))
             for _ in range(3)]
    kw = dict(lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov, ns_steps=5)
    ours = [mat.clone().requires_grad_(), stack.clone().requires_grad_()]
    dummy = torch.zeros(1, requires_grad=True)  # the AdamW side
    _steps(Muon(ours, torch.optim.AdamW([dummy]), **kw), ours, grads)

    ref = [mat.clone().requires_grad_()] + [stack[e].clone().requires_grad_() for e in range(4)]
    opt = torch.optim.Muon(ref, adjust_lr_fn="match_rms_adamw", **kw)
    _steps(opt, ref, [(a, *b.unbind(0)) for a, b in grads])
    torch.testing.assert_close(ours[0].detach(), ref[0].detach(), rtol=0, atol=1e-6)
    torch.testing.assert_close(ours[1].detach(), torch.stack([r.detach() for r in ref[1:]]),
                               rtol=0, atol=1e-6)
    assert not torch.equal(ours[1].detach(), stack)  # it moved


@pytest.mark.parametrize("model", ["tiny_moe", "tiny_dense"])
def test_muon_takes_the_hidden_matrices_and_adamw_the_rest(model):
    """The head is found as the model's head, not by its width: tiny_dense's FFN maps onto
    256 features, as many as the vocabulary, and stays with Muon."""
    from moe_exp.model import build_model
    from moe_exp.optim import build_optimizer

    cfg = compose(["optim=muon", "logger=none", f"model={model}"])
    model = build_model(cfg.model)
    opt, sched, impl = build_optimizer(model, cfg, torch.device("cpu"))
    names = {id(p): n for n, p in model.named_parameters()}
    muon = {names[id(p)] for g in opt.param_groups if g["muon"] for p in g["params"]}
    adamw = {names[id(p)] for g in opt.adamw.param_groups for p in g["params"]}
    assert muon | adamw == set(names.values()) and not muon & adamw
    assert adamw == {"embed.weight", "head.weight", "norm.weight",
                     *(n for n in names.values() if n.endswith("norm.weight"))}
    assert "layers.0.attn.wq.weight" in muon
    if cfg.model.num_experts:
        assert {"layers.0.ffn.experts.w1", "layers.1.ffn.router.gate.weight"} <= muon
    else:
        assert {"layers.0.ffn.w1.weight", "layers.1.ffn.w3.weight"} <= muon
    assert impl == "muon+adamw-fused"
    opt.step()
    sched.step()  # the schedule's lr reaches the AdamW groups too (shared dicts)
    assert opt.adamw.param_groups[0]["lr"] != cfg.optim.lr
    assert {g["lr"] for g in opt.adamw.param_groups} == {g["lr"] for g in opt.param_groups}


# One Newton-Schulz step where a test's property does not depend on how many: they run in bf16,
# which a CPU without bf16 matmuls emulates (~2.5 s a tiny_moe step at the default 5). The
# update at 5 steps is test_update_equals_torch_muon_per_matrix_and_per_expert's.
NS1 = "optim.ns_steps=1"


def test_muon_run_learns_and_records_its_optimizer(tmp_path):
    rec = run_inproc(["optim=muon", NS1, "logger=none", "train.steps=8",
                      "train.warmup_steps=1"], tmp_path)
    assert rec["status"] == "ok", rec["error"]
    assert rec["optim"] == "muon" and rec["optim_impl"].startswith("muon+adamw-")
    assert rec["loss_last"] < rec["loss_first"] - 0.5


def test_state_dict_round_trip_carries_both_optimizers():
    """Saved and loaded into a fresh optimizer, the next step is the one the original takes,
    and the schedule still reaches the AdamW groups."""
    from moe_exp.model import build_model
    from moe_exp.optim import build_optimizer

    cfg = compose(["optim=muon", NS1, "logger=none"])
    torch.manual_seed(0)
    a, b = build_model(cfg.model), build_model(cfg.model)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 16))
    opt_a, _, _ = build_optimizer(a, cfg, torch.device("cpu"))
    for _ in range(2):
        a(tokens, tokens).loss.backward()
        opt_a.step()
        opt_a.zero_grad()
    saved = copy.deepcopy(opt_a.state_dict())  # as torch.save would (no shared tensors)
    kinds = [set(st) for st in saved["state"].values()]  # (torch's format: DCP reads it)
    assert {"momentum_buffer"} in kinds and {"step", "exp_avg", "exp_avg_sq"} in kinds
    assert len(kinds) == len(list(a.parameters()))
    b.load_state_dict(a.state_dict())
    opt_b, sched_b, _ = build_optimizer(b, cfg, torch.device("cpu"))
    opt_b.load_state_dict(saved)
    for m, o in ((a, opt_a), (b, opt_b)):
        m(tokens, tokens).loss.backward()
        o.step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=0, atol=0)
    sched_b.step()
    assert opt_b.adamw.param_groups[0]["lr"] == opt_b.param_groups[0]["lr"]
    assert opt_b.param_groups[-1] is opt_b.adamw.param_groups[-1]


def test_new_knobs_keep_older_config_hashes():
    """adamw hashes are those from before muon existed (a knob only muon reads changes
    nothing for adamw), as are those of runs with parallel.prefetch at its default; muon's
    settings are part of muon runs' hashes."""
    from omegaconf import OmegaConf

    from moe_exp.config import KNOBS
    from moe_exp.results import config_hash

    def h(*o):
        return config_hash(OmegaConf.to_container(compose(["logger=none", *o]), resolve=True))

    assert h() == h("optim.ns_steps=3") == h("optim.momentum=0.5")
    assert h() == "86eee63098e3"  # the default run's hash before optim=muon (056edc5)
    # comm.* (task=comm's settings) change nothing a bench run measures; a comm run's do
    assert h() == h("comm.iters=3") and h("task=comm") != h("task=comm", "comm.iters=3")
    # keys this configuration does not read (given to every job of a sweep over
    # parallel=none,ddp or data=markov,tokens): rank settings and accum_no_sync on one rank,
    # the token file on markov data
    assert h() == h("parallel.profile_steps=0", "parallel.backend=gloo", "parallel.timeout_s=9",
                    "parallel.accum_no_sync=false", "data=markov", "data.path=x.bin")
    assert h("parallel=ddp") != h("parallel=ddp", "parallel.profile_steps=0")
    assert h("parallel=ddp") != h("parallel=ddp", "parallel.accum_no_sync=false")
    assert h("parallel=expert") == h("parallel=expert", "parallel.accum_no_sync=false")
    assert h("data.branching=3") != h()
    assert h("precision=bf16") == h("precision=bf16", "precision.fp8_recipe=rowwise")
    # a dense model's routing keys stay in its hash (a dense preset may inherit other values
    # from its MoE parent; a sweep over model=dense,moe x dispatch keeps the dense rows apart)
    assert h("model=tiny_dense") != h("model=tiny_dense", "model.dispatch=loop")
    assert h("model.top_k=1") != h() != h("model.dispatch=loop")
    assert h("parallel=fsdp") != h("parallel=fsdp", "parallel.prefetch=1")
    # past the model's 2 layers, prefetch acts as prefetching both
    assert h("parallel=fsdp", "parallel.prefetch=2") == h("parallel=fsdp", "parallel.prefetch=5")
    # task=comm hashes what the collectives read: not the model, precision, parallel layout
    comm = h("task=comm")
    assert comm == h("task=comm", "model=small_moe", "precision=bf16", "parallel=fsdp",
                     "parallel.prefetch=2", "train.steps=3", "hardware.deterministic=true")
    assert comm != h("task=comm", "parallel.backend=gloo") != h("task=comm", "hardware.devices=4")
    assert KNOBS["optim.ns_steps"].unread == "drop"  # (left out of other optimizers' hashes)
    assert h("optim=muon") != h("optim=muon", "optim.ns_steps=3")


def test_memory_check_counts_muons_single_buffer():
    """The fit check's lower bound: 12 B per hidden-matrix parameter with Muon, 16 with
    AdamW (mixtral_8x7b in 100 GiB: AdamW needs ~700 GiB, Muon ~3/4 of it)."""
    import re

    from moe_exp.validate import check_memory

    def need(optim):
        cfg = compose(["model=mixtral_8x7b", f"optim={optim}", "hardware=cpu",
                       "hardware.memory_gib=100"])
        with pytest.raises(Exception) as e:
            check_memory(cfg)
        assert f"optim={optim}" in str(e.value)
        return float(re.search(r">= ([\d,]+) GiB", str(e.value)).group(1).replace(",", ""))

    assert 0.74 < need("muon") / need("adamw") < 0.76


def test_shard_rows_split_as_dtensor_shards():
    """The round-robin's row counts per rank are DTensor Shard(0)'s (torch.chunk's, padded
    with empty shards), e.g. 5 rows on 4 ranks: 2, 2, 1, 0."""
    import torch

    from moe_exp.optim.sharded_ns import shard_rows

    for n in range(0, 20):
        for world in range(1, 6):
            chunks = [len(c) for c in torch.arange(n).chunk(world)] if n else []
            assert shard_rows(n, world) == chunks + [0] * (world - len(chunks)), (n, world)
