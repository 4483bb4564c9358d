"""Each knob declared once (config.py): the declarations cover every key, and everything
derived from them keeps every recorded config_hash."""
from hash_cases import current, recorded


def test_every_presets_config_hash_is_the_one_recorded():
    """Every group option (and +seed_row) alone, and each recorded key of it changed, hash as
    recorded (tests/data/config_hashes.json, made by tests/hash_cases.py at 87b7797): a
    change to how the hash is made or to a preset must not move old results' hashes."""
    want = recorded()
    got = current(set(want["keys"]))["bases"]
    for base, rec in want["bases"].items():
        assert base in got, f"{base}: no longer composes"
        assert got[base] == rec, (f"{base}: hashes moved (python tests/hash_cases.py --show "
                                  "here and at the recording commit, then diff)")
