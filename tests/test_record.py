"""The record's declaration (moe_exp/record.py): the tasks' sections, the knobs' columns,
the docs that explain them, and the type check the run tests apply to real records."""
import re
from pathlib import Path

import pytest

from conftest import ROOT, compose


def test_docs_record_md_explains_every_declared_key():
    """Each key of the header and of every task's section is named in docs/record.md (the
    knobs' columns are explained by their declarations: --help)."""
    from moe_exp.record import SECTIONS, Header, names

    text = (ROOT / "docs" / "record.md").read_text()
    named = {w for quoted in re.findall(r"`([^`]+)`", text) for w in quoted.split()}
    missing = [k for s in (Header, *SECTIONS) for k in names(s) if k not in named]
    assert missing == []


def test_every_task_has_a_section_and_the_registry_is_the_tasks_choices():
    from moe_exp.config import CHOICES
    from moe_exp.record import SECTIONS
    from moe_exp.tasks import TASKS

    assert sorted(TASKS) == sorted(CHOICES["task"])
    assert all(t.section in SECTIONS for t in TASKS.values())


def test_a_record_holds_each_knobs_column_with_its_value():
    """The configuration's columns come from the knobs' declarations (Knob.column)."""
    from moe_exp.pipeline import container
    from moe_exp.record import columns
    from moe_exp.results import FIELDS, new_record

    cfg = container(compose(["optim.schedule=wsd", "train.attention=math"]))
    rec = new_record(cfg, [])
    assert rec["lr_schedule"] == "wsd" and rec["attention"] == "math"
    assert rec["world_size"] == cfg["hardware"]["devices"] and rec["task"] == "bench"
    contract = {"model", "precision", "parallel", "hardware", "data", "optim",
                "activation_checkpointing", "compile", "world_size", "micro_batch_size",
                "grad_accum_steps", "seq_len"}
    assert contract <= set(columns()) and contract <= set(FIELDS)


@pytest.mark.parametrize("overrides", [[], ["model=tiny_deepseek", "++hardware.peak_flops.fp32=1",
                                        "+extra.x=1", "hardware=h100", "parallel=fsdp"],
                                       ["task=comm", "comm.ops=[all_reduce]"]])
def test_the_typed_config_is_omegaconfs_object_of_the_schema(overrides):
    """config.typed builds what OmegaConf.to_object makes of the structured config."""
    import dataclasses

    from omegaconf import OmegaConf

    from moe_exp.config import RunConfig, typed
    from moe_exp.pipeline import container

    d = container(compose(overrides))
    got = typed(d)
    assert got == OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RunConfig), d))
    assert dataclasses.asdict(got) == d


def test_the_type_check_names_what_a_record_must_not_hold():
    from moe_exp.record import check

    assert check({"status": "ok", "tokens_per_s": 3, "tokens_per_s_min": 2.5}) == []
    assert check({"status": "ok", "colour": "red", "model": 3, "mfu": True}) == [
        "colour: not declared (record.py)", "model: 3 is not typing.Optional[str]",
        "mfu: True is not typing.Optional[float]"]


def _outside(r):
    """A value just outside a Range."""
    if r.lo is not None:
        return r.lo if r.lo_open else (r.lo - 1 if isinstance(r.lo, int) else r.lo - 0.5)
    return r.hi if r.hi_open else (r.hi + 1 if isinstance(r.hi, int) else r.hi + 0.5)


def test_each_declared_range_is_checked():
    """Every Knob.check of a key read by every option refuses a value just outside it, in
    one line naming the key; the defaults are in range."""
    from omegaconf import OmegaConf

    from moe_exp.config import KNOBS, ConfigError
    from moe_exp.validate import check_ranges

    cfg = compose([])
    check_ranges(cfg)
    OmegaConf.set_struct(cfg, False)
    ranged = [k for k, d in KNOBS.items() if d.check and not d.read_by]
    assert len(ranged) > 40
    for key in ranged:
        default = OmegaConf.select(cfg, key)
        for r in KNOBS[key].check:
            OmegaConf.update(cfg, key, _outside(r), force_add=True)
            with pytest.raises(ConfigError, match=rf"^{re.escape(key)}: must be "):
                check_ranges(cfg)
        OmegaConf.update(cfg, key, default)
