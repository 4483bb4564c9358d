"""Each knob declared once (config.py): the declarations cover every key, and everything
derived from them keeps every recorded config_hash."""
from hash_cases import current, recorded


def test_every_presets_config_hash_is_the_one_recorded():
    """Every group option (and +seed_row) alone, and each recorded key of it changed, hash as
    recorded (tests/data/config_hashes.json, made by tests/hash_cases.py at 87b7797): a
    change to how the hash is made or to a preset must not move old results' hashes."""
    want = recorded()
    got = current(set(want["keys"]), want["choices"], set(want["bases"]))["bases"]
    for base, rec in want["bases"].items():
        assert base in got, f"{base}: no longer composes"
        assert got[base] == rec, (f"{base}: hashes moved (python tests/hash_cases.py --show "
                                  "here and at the recording commit, then diff)")


def test_every_key_of_every_schema_is_declared():
    """Each field of each schema carries its Knob (knobs.knob): a one-line doc, its choices,
    which option reads it (an existing key, with values that key allows) and what the hash
    makes of it where unread."""
    import dataclasses

    from moe_exp.config import CHOICES, DEFAULTS, KNOBS, RunConfig
    from moe_exp.knobs import declarations

    schemas = [f.default_factory for f in dataclasses.fields(RunConfig)
               if "group" in f.metadata]
    keys = {f"{f.name}.{g.name}" for f in dataclasses.fields(RunConfig) if "group" in f.metadata
            for g in dataclasses.fields(f.default_factory)}
    keys |= {f.name for f in dataclasses.fields(RunConfig) if "group" not in f.metadata}
    assert len(schemas) == 12 and set(KNOBS) == keys == set(DEFAULTS)
    assert declarations(RunConfig) == KNOBS
    for key, knob in KNOBS.items():
        assert knob.doc and "\n" not in knob.doc, key
        assert knob.unread in ("default", "drop", "keep"), key
        if knob.choices:
            assert DEFAULTS[key] in knob.choices and CHOICES[key] == list(knob.choices), key
        for reads in knob.read_by:
            assert reads.key in KNOBS and reads.key != key, key
            allowed = KNOBS[reads.key].choices
            assert reads.positive or allowed and set(reads.values) <= set(allowed), key
        if knob.off is not None:  # (a key without choices: off is its default)
            assert knob.off in (knob.choices or (DEFAULTS[key],)), key


def test_a_field_without_a_declaration_is_refused():
    import dataclasses

    import pytest

    from moe_exp.knobs import declarations, group, knob

    @dataclasses.dataclass
    class Group:
        ok: int = knob(1, "declared")
        bare: int = 2

    @dataclasses.dataclass
    class Root:
        g: Group = group(Group, "a group")

    with pytest.raises(TypeError, match="g.bare: a schema field without a declaration"):
        declarations(Root)


def test_derived_checks_follow_the_declarations():
    """What reads a key (Knob.read_by) drives both the refusal and the hash: set where only
    another option reads it, a run is invalid, and a sweep's job (whose command line picks
    the group) runs with the key counted at its default."""
    from conftest import compose

    from moe_exp.results import config_hash
    from moe_exp.validate import unread_keys
    from omegaconf import OmegaConf

    def h(*o):
        return config_hash(OmegaConf.to_container(compose(["logger=none", *o]), resolve=True))

    o = ["parallel=fsdp", "parallel.bucket_cap_mb=50"]  # (DDP's: FSDP reads no buckets)
    picks, option, err = unread_keys(compose(o), o)["parallel.bucket_cap_mb"]
    assert picks == ("parallel", "parallel.name") and option == "parallel=ddp"
    assert str(err) == ("parallel.bucket_cap_mb: read by parallel=ddp only; this run has "
                        "parallel.name=fsdp (use parallel=ddp parallel.bucket_cap_mb=50.0)")
    assert h(*o) == h("parallel=fsdp") != h("parallel=ddp", "parallel.bucket_cap_mb=50")
    # rank settings are given to every job of a sweep over parallel=none,ddp: never refused
    o = ["parallel.profile_steps=0", "parallel.timeout_s=60"]
    assert unread_keys(compose(o), o) == {} and h(*o) == h()
    # logger=none's own mode (disabled) is what the option means, not a mistake
    o = ["logger=none", "logger.mode=disabled"]
    assert unread_keys(compose(o), o) == {}


def test_help_lists_every_key_and_help_key_its_doc():
    from moe_exp.config import KNOBS
    from moe_exp.help import keys_text, topic_text

    text = keys_text(10_000)  # (cut to the terminal's width otherwise)
    for key, knob in KNOBS.items():
        assert f"    {key}=" in text and knob.doc in text, key
        assert knob.doc in topic_text(key, 10_000), key
