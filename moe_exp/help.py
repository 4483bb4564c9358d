"""`--help`'s groups and keys, from the config tree and each knob's declaration.

They are OmegaConf resolvers that the help template in conf/run.yaml calls; Hydra renders
the page."""
from __future__ import annotations

import textwrap

from omegaconf import OmegaConf

from . import screen
from .config import CONF, DEFAULTS, KNOBS, default_choices, group_options


def _group_lines(name: str, picked: dict, cols: int, indent: str = "") -> list[str]:
    """A group's options as `group=a (default)|b|c`, wrapped after a `|` to `cols`."""
    options = group_options(name)
    if not options:
        return []
    if name in picked:
        first = picked[name]
        options = [f"{first} (default)"] + [o for o in options if o != first]
    lines = [f"{indent}{'' if name in picked else '+'}{name}={options[0]}"]
    for o in options[1:]:
        if len(lines[-1]) + len(o) + 2 > cols:  # (room for the `|`)
            lines[-1] += "|"
            lines.append(f"{indent}    {o}")
        else:
            lines[-1] += f"|{o}"
    return lines


def groups_text(cols: int | None = None) -> str:
    """One config group a line (wrapped to the terminal): its options, the default first.

    Preset groups a run does not have by default are shown as they are added, with `+`:
    +sweep=optimizations."""
    cols, picked, lines = cols or screen.width(), default_choices(), []
    for d in sorted(p for p in CONF.iterdir() if p.is_dir() and p.name != "hydra"):
        lines += _group_lines(d.name, picked, cols, "  ")
    return "\n".join(lines)


def _key_line(key: str) -> str:
    knob, value = KNOBS[key], DEFAULTS[key]
    shown = "null" if value is None else str(value).lower() if isinstance(value, bool) \
        else value
    allowed = f" [{'|'.join(knob.choices)}]" if knob.choices else ""
    return f"{key}={shown}{allowed}"


def _key_doc(key: str) -> str:
    knob = KNOBS[key]
    only = f" ({' or '.join(r.option() for r in knob.read_by)} only)" if knob.read_by else ""
    return knob.doc + only


def keys_text(cols: int | None = None) -> str:
    """One line per key, cut to the terminal: key=default, its choices, what it does.

    `--help KEY` (or a group, as `--help train`) shows the whole text."""
    cols, lines, group = cols or screen.width(), [], None
    for key in KNOBS:
        head = key.split(".")[0] if "." in key else ""
        if head != group:
            group = head
            lines.append(f"  {head}:" if head else "  (top level):")
        lines.append(screen.cut(f"    {_key_line(key)}  {_key_doc(key)}", cols))
    return "\n".join(lines)


def topic_text(word: str, cols: int | None = None) -> str | None:
    """`--help WORD`: the whole text of a key, or of a group's options and keys, wrapped to
    the terminal; None where WORD names neither."""
    cols = cols or screen.width()
    keys = [k for k in KNOBS if k == word or k.startswith(word + ".")]
    lines = _group_lines(word, default_choices(), cols) if word != "hydra" and \
        (CONF / word).is_dir() else []
    if not keys and not lines:
        return None
    lines += [""] if lines and keys else []
    for k in keys:
        lines += textwrap.wrap(_key_line(k), cols, subsequent_indent="    ",
                               break_on_hyphens=False)
        lines += textwrap.wrap(_key_doc(k), cols, initial_indent="    ",
                               subsequent_indent="    ", break_on_hyphens=False)
    return "\n".join(lines)


def register() -> None:
    for name, fn in (("moe_exp_groups", groups_text), ("moe_exp_keys", keys_text)):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)


register()
