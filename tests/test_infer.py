"""task=infer: the KV cache gives the full forward pass's logits and greedy tokens; a run's
record; weights from a training run's checkpoint; bad options fail before any work."""
import json

import pytest
import torch
import torch.nn.functional as F
from conftest import cli_inproc, compose, off_contract, run_cli, run_inproc

from moe_exp.run import prepare

FAST = ["task=infer", "logger=none", "infer.batch_size=2", "infer.prompt_len=8",
        "infer.new_tokens=6", "infer.batches=2"]


@torch.no_grad()
def generate_uncached(model, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """The same greedy tokens by a full forward pass over the whole sequence at every step
    (no cache): the reference the cache is tested against."""
    from moe_exp.model.cache import KVCache
    from moe_exp.model.transformer import decode

    seq = prompts
    for _ in range(new_tokens):
        logits, _ = decode(model, seq, KVCache(len(model.layers), seq.shape[1]))
        seq = torch.cat([seq, logits[:, -1].argmax(-1, keepdim=True)], 1)
    return seq[:, prompts.shape[1]:]


@pytest.mark.parametrize("model", ["tiny_moe", "tiny_deepseek", "tiny_qwen3", "tiny_dense"])
def test_the_kv_cache_gives_the_full_passes_logits_and_tokens(model):
    """GQA, MLA, QK-norm and a dense model: decoding token by token from a prefill equals
    the forward pass over the whole sequence (to float rounding: below 1e-8 in fp64), from an
    empty cache its loss is the training forward's to the bit, and greedy generation picks
    the tokens the uncached full pass picks."""
    from moe_exp.infer.generate import generate
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
    assert off_contract(rec) == set()
    assert rec["generated_tokens"] == 2 * 6 * 2 and rec["measured_batches"] == 2
    assert rec["prefill_tokens_per_s"] > 0 and rec["decode_tokens_per_s"] > 0
    assert 0 < rec["token_latency_ms_p50"] <= rec["token_latency_ms_p90"] \
        <= rec["token_latency_ms_p99"]
    assert rec["ttft_ms"] > 0 and rec["step_time_ms"] == rec["token_latency_ms_p50"]
    assert 0 <= rec["cpu_other_load"] <= 1  # (the measured batches' window, as bench's)
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


@pytest.mark.slow
def test_a_compiled_decode_step_generates_the_eager_tokens():
    """train.compile's decode step (what task=infer runs compiled; a compiled run's record:
    the seed_inference preset's last row) greedy-decodes the tokens the eager one does."""
    from moe_exp.infer.generate import generate
    from moe_exp.model import build_model
    from moe_exp.optimizations import compile_decode

    cfg = compose([*FAST, "model.num_layers=1"])  # (a block compiles in half the time)
    torch.manual_seed(0)
    m = build_model(cfg.model).eval()
    prompts = torch.randint(0, cfg.model.vocab_size, (2, 8))
    cpu = torch.device("cpu")
    eager = generate(m, prompts, 6, torch.no_grad, cpu)
    compiled = generate(m, prompts, 6, torch.no_grad, cpu, step=compile_decode("default"))
    assert torch.equal(compiled.tokens, eager.tokens)


@pytest.mark.parametrize("override, says", [
    ("infer.new_tokens=0", "error: infer.new_tokens: must be in 1..1,048,576, got 0"),
    ("infer.prompt_len=120", "error: infer.new_tokens: infer.prompt_len + new_tokens = 152 "
                             "exceeds model.max_seq_len=128"),
    ("parallel=ddp", "error: parallel: task=infer runs on one device"),
    ("train.compile=default infer.warmup=0", "error: infer.warmup: must be >= 1 with "
                                             "train.compile=default"),
    ("infer.batch_sise=2", "error: infer.batch_sise: no such key in infer"),
    ("infer.experts_resident=0", "error: infer.experts_resident: must be in 1..model.num_experts"
                                 "=8 or null, got 0"),
    ("infer.usage_threshold=1", "error: infer.usage_threshold: must be in [0, 1), got 1"),
    ("infer.prefetch=2", "error: infer.prefetch: read by expert residency "
                         "(infer.experts_resident > 0) only"),
    ("model=tiny_dense infer.experts_resident=2", "error: infer.experts_resident: a MoE model's"),
    ("infer.batching=static infer.timeout_ms=10", "error: infer.timeout_ms: read by "
                                                  "infer.batching=dynamic only"),
    ("infer.max_batch_size=4", "error: infer.max_batch_size: read by a served stream"),
    ("infer.batching=dynamic infer.arrival_rate=0", "error: infer.arrival_rate: must be in "
                                                    "[1e-06, 1,000,000,000] requests/s, got 0"),
    ("infer.batching=fifo", "error: infer.batching: 'fifo' is not one of"),
])
def test_bad_inference_options_fail_before_any_work(override, says, tmp_path):
    r = cli_inproc(["task=infer", "logger=none", *override.split()], tmp_path)
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


def test_the_expert_cache_matches_a_hand_computed_trace():
    from moe_exp.infer.experts import ExpertCache

    c = ExpertCache(capacity=2, expert_bytes=10)
    c.fetch([0, 1])  # two misses: [0, 1]
    c.fetch([0, 2])  # 0 hits; 2 misses and evicts 1 (least recently used): [0, 2]
    c.prefetch([1])  # loaded ahead, evicts 0: [2, 1]
    c.fetch([1, 0])  # 1 hits (a prefetched one); 0 misses, evicts 2: [1, 0]
    assert (c.hits, c.misses, c.prefetched, c.prefetch_hits) == (2, 4, 1, 1)
    assert c.moved_bytes() == 50 and list(c.resident) == [1, 0]


def test_residency_fetches_each_steps_experts_and_rare_ones_are_dropped():
    from moe_exp.infer.experts import Residency, drop_rare, expert_bytes, moe_layers
    from moe_exp.model import build_model
    from moe_exp.model.cache import KVCache
    from moe_exp.model.transformer import decode

    cfg = compose(["model=tiny_moe"])
    torch.manual_seed(0)
    m = build_model(cfg.model).eval()
    r = Residency(m, resident=3, prefetch=0)
    planted = torch.tensor([[[1, 0, 2, 0, 0, 0, 0, 5], [0, 0, 0, 0, 0, 0, 0, 1]],
                            [[0, 1, 0, 0, 0, 0, 0, 1], [0, 0, 0, 0, 0, 0, 0, 4]]])
    for step in planted:  # layer 0: {0, 2, 7} then {1, 7}: 3 misses, then 1 miss 1 hit
        r.step(step)
    assert [(c.hits, c.misses) for c in r.caches] == [(1, 4), (1, 1)]
    b = expert_bytes(moe_layers(m)[0])
    assert b == 3 * cfg.model.hidden_size * cfg.model.ffn_hidden_size * 4
    assert r.figures(tokens=5) == {"expert_hit_rate": 2 / 7,
                                   "expert_bytes_moved_per_token": 5 * b / 5,
                                   "expert_prefetch_hit_rate": None}
    usage = torch.tensor([[10, 10, 10, 10, 10, 10, 1, 0], [10] * 8])
    per_layer, saved, hooks = drop_rare(m, usage, 0.05)
    assert per_layer == [2, 0] and saved == 2 * b
    tokens = torch.randint(0, cfg.model.vocab_size, (16, 12))
    _, counts = decode(m, tokens, KVCache(len(m.layers), 12))
    assert counts[0, 6:].sum() == 0 and counts[0].sum() == 16 * 12 * cfg.model.top_k
    for h in hooks:
        h.remove()
    _, counts = decode(m, tokens, KVCache(len(m.layers), 12))
    assert counts[0, 6:].sum() > 0  # (the hooks gone: the router's own choices again)


def test_infer_records_residency_and_selective_loading(tmp_path):
    every = run_inproc([*FAST, "infer.experts_resident=8"], tmp_path / "all")
    assert every["status"] == "ok", every["error"]
    # every expert stays once loaded (in the warmup batch): the measured batches all hit
    assert every["expert_hit_rate"] == 1.0 and every["expert_bytes_moved_per_token"] == 0
    assert every["device_weights_gib"] == every["weights_gib"]
    few = run_inproc([*FAST, "infer.experts_resident=2", "infer.prefetch=2",
                      "infer.usage_threshold=0.2"], tmp_path / "few")
    assert few["status"] == "ok", few["error"]
    assert few["expert_hit_rate"] < 1 and few["expert_bytes_moved_per_token"] > 0
    assert 0 <= few["expert_prefetch_hit_rate"] <= 1
    # a share of 0.2 is above every expert's of 8: each layer keeps its top_k = 2
    assert few["experts_dropped"] == 2 * 6 and few["dropped_experts_gib"] > 0
    assert few["device_weights_gib"] < few["weights_gib"] - few["dropped_experts_gib"] + 1e-12
    assert few["eval_loss_change"] == pytest.approx(few["eval_loss"] - every["eval_loss"])
    assert few["expert_move_ms_per_token"] is None and \
        few["null_reasons"]["expert_move_ms_per_token"].startswith("the moves are accounted")
    assert every["eval_loss_change"] is None


def test_batching_policies_on_a_planted_stream_and_cost():
    """A prefill costs 0.1 s and a decode step 0.01 s at any batch size; requests arrive at
    0, 0.2 and 0.5 s wanting 3, 2 and 1 tokens; max_batch_size 2, timeout 50 ms."""
    from moe_exp.infer.batching import Cost, Request, figures, serve

    cost = Cost([1, 2], [0.1, 0.1], [0.01, 0.01], prompt_len=8)

    def run(policy):
        reqs = [Request(0.0, 8, 3), Request(0.2, 8, 2), Request(0.5, 8, 1)]
        s = serve(reqs, policy, 2, 0.05, cost)
        return s, [t for r in reqs for t in (r.first, r.done)]

    s, times = run("dynamic")  # r0 leaves alone at its timeout; r1 waits 50 ms for r2, alone
    assert times == pytest.approx([0.15, 0.17, 0.35, 0.36, 0.6, 0.6])
    assert [t for t, _ in s.batches] == pytest.approx([0.05, 0.25, 0.5])
    assert s.held == pytest.approx([0.05, 0.05, 0.0])
    s, times = run("static")  # r0 waits for r1 to fill the batch; r2 is the stream's end
    assert times == pytest.approx([0.3, 0.32, 0.3, 0.31, 0.6, 0.6])
    assert [n for _, n in s.batches] == [2, 1] and s.steps == [2, 2]
    s, times = run("continuous")  # nothing waits: each joins at once
    assert times == pytest.approx([0.1, 0.12, 0.3, 0.31, 0.6, 0.6])
    f = figures(s)
    assert f["requests"] == 3 and f["served_tokens_per_s"] == pytest.approx(6 / 0.6)


def test_dynamic_batching_never_exceeds_the_batch_nor_holds_past_the_timeout():
    from moe_exp.infer.batching import Cost, serve, stream

    cost = Cost([1, 4, 8], [0.02, 0.03, 0.05], [0.002, 0.003, 0.004], prompt_len=32)
    for rate in (5.0, 50.0, 500.0):
        for policy in ("static", "dynamic", "continuous"):
            reqs = stream(200, rate, 32, 16, 0.5, seed=1)
            s = serve(reqs, policy, 8, 0.03, cost)
            assert max(n for _, n in s.batches) <= 8 and max(s.steps) <= 8
            assert all(r.arrival <= r.first <= r.done for r in reqs)
            if policy == "dynamic":
                assert max(s.held) <= 0.03 + 1e-12
    a, b = stream(50, 20.0, 32, 16, 0.5, 3), stream(50, 20.0, 32, 16, 0.5, 3)
    assert [(r.arrival, r.prompt, r.output) for r in a] == \
        [(r.arrival, r.prompt, r.output) for r in b]  # (same seed, same stream)
    assert all(16 <= r.prompt <= 32 and 8 <= r.output <= 16 for r in a)


def test_infer_serves_a_stream(tmp_path):
    rec = run_inproc([*FAST, "infer.batching=dynamic", "infer.requests=12",
                      "infer.max_batch_size=4", "infer.arrival_rate=100"], tmp_path)
    assert rec["status"] == "ok", rec["error"]
    assert rec["requests"] == 12 and rec["batch_size_max"] <= 4 and off_contract(rec) == set()
    assert rec["tokens_per_s"] == rec["served_tokens_per_s"] > 0
    assert rec["request_latency_ms_p50"] <= rec["request_latency_ms_p99"]
    assert rec["serving_costs"]["batch_sizes"] == [1, 2, 4]


def test_int8_weights_change_a_trained_models_loss_little_and_save_memory(tmp_path):
    """infer.quantize=int8 (torchao, weight-only): every Linear but the routers' gates, and
    the stacked experts; the held-out loss of a trained tiny model moves by less than 0.01."""
    train = run_inproc(["logger=none", "train.steps=40", "train.warmup_steps=0",
                        "train.checkpoint_every=40", "train.micro_batch_size=4",
                        "train.eval_sequences=0"], tmp_path / "t")
    assert train["status"] == "ok", train["error"]
    o = [*FAST, f"infer.checkpoint={tmp_path / 't'}"]
    none = run_inproc(o, tmp_path / "none")
    q = run_inproc([*o, "infer.quantize=int8"], tmp_path / "int8")
    assert q["status"] == "ok", q["error"]
    m = compose(["model=tiny_moe"]).model
    # (q, k, v, o and w1, w3, w2 a layer; the head)
    assert q["quantized_layers"] == m.num_layers * 7 + 1
    assert 0 < abs(q["eval_loss_change"]) < 0.01 and none["eval_loss_change"] is None
    assert q["eval_loss"] - q["eval_loss_change"] == pytest.approx(none["eval_loss"])
    assert 0 < q["quantized_saved_gib"] == pytest.approx(none["weights_gib"] - q["weights_gib"])
    assert q["quantized_saved_gib"] > 0.6 * none["weights_gib"]  # (fp32 to int8: the experts
    # and Linear layers, all but the embedding and the norms)
    _, fp8 = prepare(compose([*FAST, "infer.quantize=fp8"]), [*FAST, "infer.quantize=fp8"])
    if not torch.cuda.is_available():
        assert fp8["status"] == "skipped" and fp8["error"].startswith("infer.quantize: fp8 needs")


@pytest.mark.slow
def test_seed_inference_preset_fills_the_seeds_rows(tmp_path):
    """+sweep=seed_inference: eight task=infer rows in one table (a compiled one among them),
    and the report's table of the seed's inference options beside its claims."""
    d = tmp_path / "s"
    r = run_cli(["-m", "+sweep=seed_inference", "logger=none", "model.num_layers=1",
                 "infer.prompt_len=8",
                 "infer.new_tokens=4", "infer.batches=1", "infer.eval_sequences=4",
                 "sweep.isolate=false", f"hydra.sweep.dir={d}"], tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    import pandas as pd

    df = pd.read_csv(d / "results.csv")
    assert list(df["status"]) == ["ok"] * 8 and (df["task"] == "infer").all()
    assert list(df["baseline"]) == [True] + [False] * 7
    assert list(df["compile"]) == ["off"] * 7 + ["max-autotune"]
    assert df["decode_tokens_per_s"].iloc[-1] > 0  # (the compiled decode step's)
    report = (d / "report.md").read_text()
    assert "## The seed's inference options, measured" in report
    assert "| Selective Expert Loading (max_experts_in_memory=4, usage_threshold=0.01) | " \
           "weights on the device" in report
    assert "memory table: + Selective Loading, 60% saved" in report
    assert "tokens/s served, request p50/p99" in report
    assert "| Model Compilation (torch.compile, mode=\"max-autotune\") | " in report
