"""A knob's declaration, on its schema field in config.py, from which its checks are derived.

A declaration says what the knob is, its allowed values and range, which option reads it,
what the config hash makes of it, its record column and its label in a run's summary.
Everything else is derived from these: the choice and range checks, the unread-key checks,
the hash, the record's config columns, the table's "off" values and the summary's run line.
No project imports: config.py builds its schemas with `knob`."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

LIKE_BENCH = ("tune_batch", "plan")  # tasks that read every key bench reads
NEW = object()  # a key that existed from the start: always part of the config hash


@dataclass(frozen=True)
class Reads:
    """Where a run reads a key: where `key`'s value is one of `values`, or > `above` (0)
    with `positive`.

    `what` names that option in messages; without it, `group=value` does."""
    key: str  # e.g. "parallel.name"
    values: tuple = ()
    positive: bool = False
    what: str | None = None
    above: int = 0

    def holds(self, get) -> bool:
        value = get(self.key)
        return bool(value is not None and value > self.above) if self.positive \
            else value in self.values

    @property
    def group(self) -> str:
        return self.key.split(".")[0]

    def option(self) -> str:
        """The option as messages name it.

        For example 'parallel=fsdp or expert_fsdp' or 'a MoE model (model.num_experts > 0)'."""
        if self.positive:
            return f"{self.what} ({self.key} > {self.above})" if self.what \
                else f"{self.key} > {self.above}"
        return self.what or f"{self.group}={' or '.join(map(str, self.values))}"

    def first(self) -> str:
        """The option to suggest: its first value, or `what` for a key that is no group's option.

        parallel.comm_hook=powersgd is such a key."""
        return f"{self.group}={self.values[0]}" if self.values and not self.what \
            else self.option()


def _num(x) -> str:
    """A number as a message shows it: whole ones (1.0 too) with thousands separators."""
    if isinstance(x, float) and x.is_integer() and abs(x) < 2**53:
        x = int(x)
    return f"{x:,}" if isinstance(x, int) and not isinstance(x, bool) else f"{x}"


@dataclass(frozen=True)
class Range:
    """Numbers a key allows: lo to hi, open where lo_open / hi_open; a None bound is unbounded.

    null passes: an Optional key's null means something of its own. note is what follows the
    bound in the message, such as "(0 = off)"."""
    lo: Any = None
    hi: Any = None
    lo_open: bool = False
    hi_open: bool = False
    note: str = ""

    def error(self, value) -> str | None:
        """'must be ..., got V' where value is out of range, else None."""
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            return None
        low = self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo)
        high = self.hi is not None and (value >= self.hi if self.hi_open else value > self.hi)
        if not (low or high):
            return None
        return f"must be {self.text()}, got {_num(value)}"

    def text(self) -> str:
        lo, hi = self.lo, self.hi
        if lo is not None and hi is not None:
            ints = isinstance(lo, int) and isinstance(hi, int)
            text = f"in {_num(lo)}..{_num(hi)}" if ints and not (self.lo_open or self.hi_open) \
                else f"in {'(' if self.lo_open else '['}{_num(lo)}, {_num(hi)}" \
                     f"{')' if self.hi_open else ']'}"
        elif lo is not None:
            text = f"{'>' if self.lo_open else '>='} {_num(lo)}"
        else:
            text = f"{'<' if self.hi_open else '<='} {_num(hi)}"
        return f"{text} {self.note}" if self.note else text


def at_least(lo, note: str = "") -> Range:
    return Range(lo, note=note)


def above(lo, note: str = "") -> Range:
    return Range(lo, lo_open=True, note=note)


def at_most(hi, note: str = "") -> Range:
    return Range(hi=hi, note=note)


@dataclass(frozen=True)
class Knob:
    doc: str  # one line: what it does (shown by --help)
    choices: tuple | None = None  # allowed values of a string key
    read_by: tuple = ()  # Reads, any of which holds where the key is read; () = always
    tasks: tuple = ("bench",)  # the tasks that read it (task=comm hashes only its own keys)
    also_in: tuple = ()  # tasks that read it without its changing what they measure (unhashed)
    not_in: tuple = ()  # tasks that read what bench reads, but not this key
    since: Any = NEW  # its value before it existed: left out of the hash at that value
    # where unread, the hash: "default" counts it at its default (setting it splits no row),
    # "drop" leaves it out (it came with that option: muon's keys), "keep" keeps it, and it
    # is refused only where the command line sets it (a dense preset inherits its MoE
    # parent's routing keys); elsewhere an unread key set is refused (surely the other
    # option was meant), unless unread_ok (given to every job of a sweep, as rank settings)
    unread: str = "default"
    unread_ok: bool = False
    off: Any = None  # the value that means "this optimization off" (the table's baseline)
    check: tuple = ()  # Ranges its value must be in, checked where an option reads it
    column: str | None = None  # the record's column that holds its value (any task's)
    recorded_in: tuple = ()  # tasks that record the column though they do not read the key
    summary: str | None = None  # its label in the summary's run line, shown where not off
    summary_off: bool = False  # shown at its off value too (precision=fp32)

    def records(self, task: str) -> bool:
        """Whether `task`'s record holds this knob's value in its column; else it is null."""
        return self.column is not None and (self.read_in(task) or task in self.recorded_in)

    def used_in(self, task: str) -> bool:
        """Whether any part of `task` reads this key; set on the command line for a task
        that does not, it is refused."""
        return (self.read_in(task) or task in self.also_in) and task not in self.not_in

    def read_in(self, task: str) -> bool:
        """Whether `task` reads this key.

        A LIKE_BENCH task reads what bench reads as well as its own keys: task=tune_batch's
        probes are bench runs."""
        return task in self.tasks or task in LIKE_BENCH and "bench" in self.tasks


def knob(default: Any = dataclasses.MISSING, doc: str = "", *, factory=None,
         choices=None, read_by=(), check=(), **kw) -> Any:
    """A schema field with its Knob declaration in the field's metadata."""
    read_by = (read_by,) if isinstance(read_by, Reads) else tuple(read_by)
    check = (check,) if isinstance(check, Range) else tuple(check)
    meta = {"knob": Knob(doc, tuple(choices) if choices else None, read_by, check=check,
                         **kw)}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def group(factory, doc: str, hashed: bool = True, reads_in: tuple = ()) -> Any:
    """A config group's field of the root schema.

    hashed=False: what it holds does not change what is measured, so it is left out of the
    config hash. reads_in: tasks that read every key of it that bench reads, as task=infer
    does for the model, its precision, the hardware and the data."""
    return field(default_factory=factory, metadata={"group": doc, "hashed": hashed,
                                                    "reads_in": tuple(reads_in)})


def declarations(schema) -> dict[str, Knob]:
    """{dotted key: Knob} of every field of a root schema: its groups' fields, then its own.

    A field without a declaration raises."""
    out = {}
    for f in dataclasses.fields(schema):
        if "group" in f.metadata:
            extra = f.metadata.get("reads_in", ())
            for g in dataclasses.fields(f.default_factory):
                k = _knob(f"{f.name}.{g.name}", g)
                if extra and "bench" in k.tasks:
                    k = dataclasses.replace(k, tasks=k.tasks + extra)
                out[f"{f.name}.{g.name}"] = k
        else:
            out[f.name] = _knob(f.name, f)
    return out


def _knob(key: str, f) -> Knob:
    if "knob" not in f.metadata:
        raise TypeError(f"{key}: a schema field without a declaration (use knobs.knob)")
    return f.metadata["knob"]


def defaults(schema) -> dict[str, Any]:
    """{dotted key: its schema default}."""
    out = {}
    for k, v in dataclasses.asdict(schema()).items():
        if k in {f.name for f in dataclasses.fields(schema) if "group" in f.metadata}:
            out.update({f"{k}.{leaf}": d for leaf, d in v.items()})
        else:
            out[k] = v
    return out


def unhashed_groups(schema) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(schema) if f.metadata.get("hashed") is False)
