"""optim=muon: the update is torch.optim.Muon's, per matrix and per expert."""
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


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest():
    from moe_exp.model import build_model
    from moe_exp.optim import build_optimizer

    cfg = compose(["optim=muon", "logger=none"])
    model = build_model(cfg.model)
    opt, sched, impl = build_optimizer(model, cfg, torch.device("cpu"))
    names = {id(p): n for n, p in model.named_parameters()}
    muon = {names[id(p)] for g in opt.param_groups if g["muon"] for p in g["params"]}
    adamw = {names[id(p)] for g in opt.adamw.param_groups for p in g["params"]}
    assert muon | adamw == set(names.values()) and not muon & adamw
    assert "embed.weight" in adamw and "head.weight" in adamw and "norm.weight" in adamw
    assert {"layers.0.attn.wq.weight", "layers.0.ffn.experts.w1",
            "layers.1.ffn.router.gate.weight"} <= muon
    assert impl == "muon+adamw-fused"
    opt.step()
    sched.step()  # the schedule's lr reaches the AdamW groups too (shared dicts)
    assert opt.adamw.param_groups[0]["lr"] != cfg.optim.lr
    assert {g["lr"] for g in opt.adamw.param_groups} == {g["lr"] for g in opt.param_groups}


def test_muon_run_learns_and_records_its_optimizer(tmp_path):
    rec = run_inproc(["optim=muon", "logger=none", "train.steps=8", "train.warmup_steps=1"],
                     tmp_path)
    assert rec["status"] == "ok", rec["error"]
    assert rec["optim"] == "muon" and rec["optim_impl"].startswith("muon+adamw-")
    assert rec["loss_last"] < rec["loss_first"] - 0.5
