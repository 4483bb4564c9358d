"""Data sources: the learnable markov default and memory-mapped token files."""
import math

import pytest
import torch

from moe_exp.data import MarkovTokens, TokenFile, prepare, read_meta

from conftest import ROOT, compose, python, run_inproc


def rows(ds) -> torch.Tensor:
    """Every sample of a MarkovTokens as (n, seq_len + 1) rows."""
    return torch.stack([torch.cat([x, y[-1:]]) for x, y in (ds[i] for i in range(len(ds)))])


def test_markov_tokens_follow_the_chain():
    ds = MarkovTokens(vocab_size=64, seq_len=32, num_samples=50, branching=4, seed=3)
    x, y = ds[0]
    assert x.shape == y.shape == (32,) and torch.equal(x[1:], y[:-1])
    successors = {}
    data = rows(ds)
    for row in data:
        for a, b in zip(row[:-1].tolist(), row[1:].tolist()):
            successors.setdefault(a, set()).add(b)
    assert max(len(s) for s in successors.values()) <= 4  # entropy <= ln 4 << ln 64
    assert torch.equal(rows(MarkovTokens(64, 32, 50, 4, 3)), data)  # seeded
    assert ds._cached[1].shape[0] == 64  # made a chunk at a time: memory is not the run's length
    with pytest.raises(IndexError):
        ds[50]


def test_runs_of_any_length_see_the_same_data(tmp_path):
    """Sample i does not depend on how many samples a run draws (steps, warmup), so runs of
    different lengths start from the same batches; token-file offsets likewise."""
    short, long = MarkovTokens(64, 32, 50, 4, 3), MarkovTokens(64, 32, 500, 4, 3)
    assert torch.equal(rows(long)[:50], rows(short)) and len(long) == 500
    assert not torch.equal(rows(MarkovTokens(64, 32, 50, 4, 4)), rows(short))  # the seed counts
    (tmp_path / "a.txt").write_text("abcdefghij" * 100)
    prepare([tmp_path / "a.txt"], tmp_path / "t.bin")
    assert TokenFile(tmp_path / "t.bin", 16, 500, 3).starts[:50] == \
        TokenFile(tmp_path / "t.bin", 16, 50, 3).starts
    # exactly seq_len + 1 tokens: one window, at offset 0
    assert TokenFile(tmp_path / "t.bin", 1000, 4).starts == [0, 0, 0, 0]


def test_prepare_cli_and_token_source_run(tmp_path, monkeypatch):
    text = tmp_path / "a.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    out = tmp_path / "corpus.bin"
    p = python(["-m", "moe_exp.data", "prepare", text, out], ROOT)
    assert p.returncode == 0, p.stderr
    meta = read_meta(out)
    assert meta["vocab_size"] == 256 and meta["num_tokens"] == len(text.read_bytes()) + 1
    ds = TokenFile(out, seq_len=64, num_samples=10)
    x, y = ds[3]
    assert torch.equal(x[1:], y[:-1]) and int(x.max()) < 256
    rec = run_inproc(["logger=none", "data=tokens", f"data.path={out}", "train.steps=10",
                      "train.micro_batch_size=2"], tmp_path / "run")
    assert rec["status"] == "ok" and rec["data"] == "tokens"
    assert rec["loss_last"] < rec["loss_first"]
    assert rec["loss_floor"] is None and "not known" in rec["null_reasons"]["loss_floor"]
    # ~ is the home directory, as in a shell (quoted: Hydra's grammar has no bare ~)
    from moe_exp.run import prepare

    monkeypatch.setenv("HOME", str(tmp_path))
    home = ["logger=none", "data=tokens", 'data.path="~/corpus.bin"']
    cfg, failed = prepare(compose(home), home)
    assert failed is None and cfg.data.path == str(out)


def test_a_relative_token_path_is_read_from_the_launch_dir_under_chdir(tmp_path):
    """hydra.job.chdir=true runs in the output dir: data.path=corpus.bin is still the file
    beside the command (it was 'no token file at corpus.bin')."""
    import json

    from conftest import run_cli

    (tmp_path / "a.txt").write_text("the quick brown fox jumps over the lazy dog. " * 400)
    prepare([tmp_path / "a.txt"], tmp_path / "corpus.bin")
    p = run_cli(["logger=none", "data=tokens", "data.path=corpus.bin", "train.steps=1",
                 "train.warmup_steps=1", "hydra.job.chdir=true", "hydra.run.dir=out"], tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    rec = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert rec["status"] == "ok" and rec["data"] == "tokens"


@pytest.mark.parametrize("sidecar,says", [
    ("{not json", "is not a token file's JSON sidecar (JSONDecodeError"),
    ('{"dtype": "float32", "vocab_size": 256, "num_tokens": 500}', "lacks an integer dtype"),
    ('{"dtype": "uint8", "vocab_size": true, "num_tokens": 500}', "lacks an integer dtype"),
    ('{"dtype": "uint8", "vocab_size": 256, "num_tokens": 5000}',
     "holds 500 bytes, but t.bin.json says 5000 uint8 tokens (5000 bytes)"),
    ('{"dtype": "uint8", "vocab_size": 50, "num_tokens": 500}',
     "holds token id 99, outside its vocabulary 0..49 (t.bin.json)")])
def test_a_sidecar_that_does_not_describe_its_token_file_fails_before_any_work(
        sidecar, says, tmp_path, monkeypatch):
    import moe_exp.tasks.protocol as runner

    (tmp_path / "t.bin").write_bytes(bytes(range(100)) * 5)
    (tmp_path / "t.bin.json").write_text(sidecar)
    monkeypatch.setattr(runner, "execute", lambda *a, **k: pytest.fail("work started"))
    rec = run_inproc(["logger=none", "data=tokens", f"data.path={tmp_path / 't.bin'}"],
                     tmp_path / "run")
    assert rec["status"] == "invalid" and rec["error"].startswith("data.path: ")
    assert says in rec["error"] and "\n" not in rec["error"]


def test_a_token_file_that_cannot_be_read_is_one_line(tmp_path, monkeypatch):
    """(An unreadable or unmappable file: a traceback and no record, before.)"""
    import moe_exp.tasks.protocol as runner
    import moe_exp.data.tokens as tokens

    (tmp_path / "t.bin").write_bytes(bytes(range(100)) * 5)
    (tmp_path / "t.bin.json").write_text('{"dtype": "int16", "vocab_size": 256, '
                                         '"num_tokens": 250}')

    def memmap(*a, **k):
        raise OSError(19, "No such device")

    monkeypatch.setattr(tokens.np, "memmap", memmap)
    monkeypatch.setattr(runner, "execute", lambda *a, **k: pytest.fail("work started"))
    rec = run_inproc(["logger=none", "data=tokens", f"data.path={tmp_path / 't.bin'}"],
                     tmp_path / "run")
    assert rec["status"] == "invalid" and rec["error"].startswith("data.path: ")
    assert "cannot be read as tokens (OSError: [Errno 19] No such device)" in rec["error"]


def prepare_cli(capsys, *args) -> tuple[int, str]:
    """`python -m moe_exp.data prepare ARGS` in this process (its main, as __main__ calls
    it; test_prepare_cli_and_token_source_run runs the module): (exit code, stderr)."""
    from moe_exp.data.__main__ import main

    code = main(["prepare", *map(str, args)])
    return code, capsys.readouterr().err


def test_prepare_cli_rejects_missing_input(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, err = prepare_cli(capsys, "nope.txt", tmp_path / "o.bin")
    assert code == 2 and "no such file: nope.txt" in err


def test_prepare_cli_rejects_inputs_with_no_text(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    out = tmp_path / "o.bin"
    code, err = prepare_cli(capsys, empty, out)
    assert code == 2 and err.startswith("error: the inputs hold no text")
    assert not out.exists()


def test_prepare_cli_never_overwrites_an_input(tmp_path, capsys):
    text = tmp_path / "a.txt"
    text.write_text("keep me")
    for out in (text, tmp_path):  # the output is an input; a directory
        code, err = prepare_cli(capsys, text, out)
        assert code == 2 and err.startswith("error: the output")
        assert "Traceback" not in err and text.read_text() == "keep me"


def test_prepare_cli_keeps_an_existing_file_unless_forced(tmp_path, capsys):
    """`prepare a.txt b.txt` (the output left off): b.txt is not a token file, so it is kept;
    --force overwrites it; an existing token file is rewritten as before."""
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("some text")
    b.write_text("my notes")
    code, err = prepare_cli(capsys, a, b)
    assert code == 2 and "is not a token file" in err and b.read_text() == "my notes"
    assert prepare_cli(capsys, a, b, "--force")[0] == 0
    first = read_meta(b)["num_tokens"]
    c = tmp_path / "c.txt"
    c.write_text("some more text")
    assert prepare_cli(capsys, c, b)[0] == 0  # b.txt is a token file now: rewritten
    assert read_meta(b)["num_tokens"] == first + len("some more text") - len("some text")


def test_data_loader_workers(tmp_path):
    rec = run_inproc(["logger=none", "data.num_workers=1", "data.prefetch_factor=2",
                      "train.steps=3"], tmp_path)
    assert rec["status"] == "ok" and rec["data_share"] < 1
    assert math.isfinite(rec["data_ms"])


def test_prepare_cli_output_errors_inputs_and_hints(tmp_path, capsys):
    """One line and exit 2 where the output cannot be written (a traceback before); a
    directory input named as one; an input given twice and a file shorter than a default
    window are warnings; the printed override reads back as the path in Hydra."""
    import shlex

    from hydra.core.override_parser.overrides_parser import OverridesParser

    from moe_exp.data.__main__ import main

    text = tmp_path / "a.txt"
    text.write_text("hello")
    assert main(["prepare", str(text), str(text / "x.bin")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: could not write {text / 'x.bin'}: {text}: ")
    assert "Traceback" not in err
    assert main(["prepare", str(text), "/dev/null"]) == 2  # (it wrote /dev/null.json)
    assert capsys.readouterr().err.startswith("error: the output /dev/null is not a regular")
    assert main(["prepare", str(tmp_path), str(tmp_path / "o.bin")]) == 2
    assert capsys.readouterr().err == f"error: a directory, not a text file: {tmp_path}\n"
    out = tmp_path / "my dir" / "c,1.bin"
    assert main(["prepare", str(text), str(text), str(out)]) == 0
    cap = capsys.readouterr()
    assert "given more than once" in cap.err and "12 tokens: a run needs more" in cap.err
    word = shlex.split(cap.out.split("data=tokens ", 1)[1])[0]
    assert OverridesParser.create().parse_override(word).value() == str(out)
    from moe_exp.data.tokens import path_override

    for path in ["data/c.bin", "c:\\x\\y", 'a"b', "1e3", "null", "tail\\", "x'y", "a=b"]:
        word = shlex.split(path_override(path))[0]
        assert OverridesParser.create().parse_override(word).value() == path, path


def test_markov_loss_floor_is_the_true_chains_loss(tmp_path):
    """loss_floor: the true chain's own next-token loss on the samples (what no model can
    beat), exact in expectation: 131k sampled tokens agree to 1e-3; one successor per
    token, 0; a run records it (a corpus: null, with why)."""
    from moe_exp.data.markov import MarkovTokens

    ds = MarkovTokens(64, 32, 4096, 4, 0)
    trans = torch.zeros(64, 64, dtype=torch.float64).scatter_add_(
        1, ds.succ, torch.full(ds.succ.shape, 0.25, dtype=torch.float64))
    nll = torch.cat([-trans[x, y].log() for x, y in (ds[i] for i in range(len(ds)))])
    assert ds.loss_floor() == pytest.approx(nll.mean().item(), abs=1e-3)
    assert ds.loss_floor() < math.log(4)  # (a successor listed twice: less than ln 4)
    assert MarkovTokens(64, 32, 1, 1, 0).loss_floor() == 0
    rec = run_inproc(["logger=none", "train.steps=2", "train.warmup_steps=1",
                      "train.micro_batch_size=2", "train.seq_len=16"], tmp_path)
    assert rec["loss_floor"] == MarkovTokens(256, 16, 1, 4, 0).loss_floor()
    assert 0 < rec["loss_floor"] < rec["loss_last"]
