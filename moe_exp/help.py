"""`--help`'s groups and keys, from the config tree and each knob's declaration.

They are OmegaConf resolvers that the help template in conf/run.yaml calls; Hydra renders
the page."""
from __future__ import annotations

from omegaconf import OmegaConf

from .config import CONF, DEFAULTS, KNOBS, default_choices, group_options


def groups_text() -> str:
    """One line per config group: its options, the default first.

    Preset groups a run does not have by default are shown as they are added, with `+`:
    +sweep=optimizations."""
    picked = default_choices()
    lines = []
    for d in sorted(p for p in CONF.iterdir() if p.is_dir() and p.name != "hydra"):
        options = group_options(d.name)
        if not options:
            continue
        if d.name in picked:
            first = picked[d.name]
            shown = [f"{first} (default)"] + [o for o in options if o != first]
            lines.append(f"  {d.name}={'|'.join(shown)}")
        else:
            lines.append(f"  +{d.name}={'|'.join(options)}")
    return "\n".join(lines)


def keys_text() -> str:
    """One line per key: key=default, its choices, what it does."""
    lines, group = [], None
    for key, knob in KNOBS.items():
        head = key.split(".")[0] if "." in key else ""
        if head != group:
            group = head
            lines.append(f"  {head}:" if head else "  (top level):")
        value = DEFAULTS[key]
        shown = "null" if value is None else str(value).lower() if isinstance(value, bool) \
            else value
        allowed = f" [{'|'.join(knob.choices)}]" if knob.choices else ""
        only = f" ({' or '.join(r.option() for r in knob.read_by)} only)" \
            if knob.read_by else ""
        lines.append(f"    {key}={shown}{allowed}  {knob.doc}{only}")
    return "\n".join(lines)


def register() -> None:
    for name, fn in (("moe_exp_groups", groups_text), ("moe_exp_keys", keys_text)):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)


register()
