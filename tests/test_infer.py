"""task=infer: the KV cache gives the full forward pass's logits and greedy tokens; a run's
record; weights from a training run's checkpoint; bad options fail before any work."""
import json

import pytest
import torch
import torch.nn.functional as F
from conftest import cli_inproc, compose, run_inproc

from moe_exp.run import prepare

FAST = ["task=infer", "logger=none", "infer.batch_size=2", "infer.prompt_len=8",
        "infer.new_tokens=6", "infer.batches=2"]


@pytest.mark.parametrize("model", ["tiny_moe", "tiny_deepseek", "tiny_qwen3", "tiny_dense"])
def test_the_kv_cache_gives_the_full_passes_logits_and_tokens(model):
    """GQA, MLA, QK-norm and a dense model: decoding token by token from a prefill equals
    the forward pass over the whole sequence (to float rounding: below 1e-8 in fp64), from an
    empty cache its loss is the training forward's to the bit, and greedy generation picks
    the tokens the uncached full pass picks."""
    from moe_exp.infer.generate import generate, generate_uncached
    from moe_exp.model import build_model
    from moe_exp.model.cache import KVCache
    from moe_exp.model.transformer import decode

    cfg = compose([f"model={model}"])
    torch.manual_seed(0)
    for dtype, tol in ((torch.float32, 2e-6), (torch.float64, 1e-8)):
        m = build_model(cfg.model).to(dtype).eval()
        tokens = torch.randint(0, cfg.model.vocab_size, (3, 20))
        with torch.no_grad():
            ce = m(tokens[:, :-1], tokens[:, 1:]).ce
        full, counts = decode(m, tokens[:, :-1], KVCache(len(m.layers), 19))
        assert F.cross_entropy(full.flatten(0, 1).float(), tokens[:, 1:].flatten()) == ce
        cache = KVCache(len(m.layers), 19)
        steps = [decode(m, tokens[:, :7], cache)[0]]
        steps += [decode(m, tokens[:, i:i + 1], cache)[0] for i in range(7, 19)]
        assert cache.pos == 19 and cache.nbytes() > 0
        assert (torch.cat(steps, 1) - full).abs().max() < tol
        assert counts.shape[0] == sum(b.is_moe for b in m.layers)
    got = generate(m, tokens[:, :6], 10, torch.no_grad, torch.device("cpu"))
    assert torch.equal(got.tokens, generate_uncached(m, tokens[:, :6], 10))
    assert len(got.token_s) == 9 and got.prefill_s > 0


def test_infer_records_throughput_latency_memory_and_expert_load(tmp_path):
    rec = run_inproc(FAST, tmp_path)
    assert rec["status"] == "ok" and rec["task"] == "infer", rec["error"]
    assert rec["generated_tokens"] == 2 * 6 * 2 and rec["measured_batches"] == 2
    assert rec["prefill_tokens_per_s"] > 0 and rec["decode_tokens_per_s"] > 0
    assert 0 < rec["token_latency_ms_p50"] <= rec["token_latency_ms_p90"] \
        <= rec["token_latency_ms_p99"]
    assert rec["ttft_ms"] > 0 and rec["step_time_ms"] == rec["token_latency_ms_p50"]
    # the KV cache: layers x (k, v) x batch x kv heads x 14 positions x head dim, fp32
    m = compose(["model=tiny_moe"]).model
    d = m.hidden_size // m.num_heads
    assert rec["kv_cache_gib"] * 2**30 == m.num_layers * 2 * 2 * m.num_kv_heads * 14 * d * 4
    assert rec["weights_gib"] * 2**30 == rec["params_total"] * 4
    # each decoded token's top_k choices (5 decode steps a batch), every layer
    assert [sum(layer) for layer in rec["tokens_per_expert"]] == [2 * 5 * 2 * m.top_k] * 2
    assert rec["micro_batch_size"] == 2 and rec["optim"] is None
    assert rec["loss_last"] is None and rec["null_reasons"]["loss_last"].startswith("task=infer")


def test_infer_loads_a_training_runs_checkpoint(tmp_path):
    train = run_inproc(["logger=none", "train.steps=4", "train.warmup_steps=0",
                        "train.checkpoint_every=4", "train.micro_batch_size=2"], tmp_path / "t")
    assert train["status"] == "ok", train["error"]
    rec = run_inproc([*FAST, f"infer.checkpoint={tmp_path / 't'}"], tmp_path / "i")
    assert rec["status"] == "ok", rec["error"]
    assert rec["weights_from"] == train["checkpoint_path"] and rec["checkpoint_load_s"] > 0
    fresh = run_inproc(FAST, tmp_path / "f")
    assert fresh["tokens_per_expert"] != rec["tokens_per_expert"]  # (other weights route
    # otherwise)
    for o, says in [
        ([f"infer.checkpoint={tmp_path / 't'}", "model.hidden_size=32"],
         f"infer.checkpoint: {train['checkpoint_path']} holds another model (hidden_size=128"),
        (["infer.checkpoint=/nonexistent"], "infer.checkpoint: no complete checkpoint in "),
    ]:
        _, bad = prepare(compose([*FAST, *o]), [*FAST, *o])
        assert bad["status"] == "invalid" and bad["error"].startswith(says), bad["error"]


@pytest.mark.parametrize("override, says", [
    ("infer.new_tokens=0", "error: infer.new_tokens: must be >= 1, got 0"),
    ("infer.prompt_len=120", "error: infer.new_tokens: infer.prompt_len + new_tokens = 152 "
                             "exceeds model.max_seq_len=128"),
    ("parallel=ddp", "error: parallel: task=infer runs on one device"),
    ("train.compile=default", "error: train.compile: not applied by task=infer yet"),
    ("infer.batch_sise=2", "error: infer.batch_sise: no such key in infer"),
])
def test_bad_inference_options_fail_before_any_work(override, says, tmp_path):
    r = cli_inproc(["task=infer", "logger=none", override], tmp_path)
    assert r.returncode == 2 and r.stderr.startswith(says), r.stderr
    assert [json.loads(f.read_text())["status"] for f in tmp_path.glob("**/metrics.json")] \
        in ([], ["invalid"])  # (no work: at most the record that says so)


def test_an_inference_sweep_is_one_table(tmp_path):
    from moe_exp.sweep.table import collect, compact, sweep_table

    for i, b in enumerate((1, 4)):
        run_inproc([*FAST, f"infer.batch_size={b}"], tmp_path / str(i))
    df, _ = sweep_table(collect(tmp_path), None, ("model",))
    cols = compact(df).columns
    assert {"first token ms", "p99 token ms"} <= set(cols)
    assert json.loads((tmp_path / "1" / "metrics.json").read_text())["micro_batch_size"] == 4
