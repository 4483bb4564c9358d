"""A knob's declaration, on its schema field (config.py): what it is, its allowed values,
which option reads it, and what the config hash makes of it. Everything else (the choice
checks, the unread-key checks, the hash, the table's "off" values) is derived from these.
No project imports: config.py builds its schemas with `knob`."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

LIKE_BENCH = ("tune_batch", "plan")  # tasks that read every key bench reads
NEW = object()  # a key that existed from the start: always part of the config hash


@dataclass(frozen=True)
class Reads:
    """A run reads the key where `key`'s value is one of `values` (or, with `positive`,
    is > 0). `what` names that option in messages (else `group=value`)."""
    key: str  # e.g. "parallel.name"
    values: tuple = ()
    positive: bool = False
    what: str | None = None

    def holds(self, get) -> bool:
        value = get(self.key)
        return bool(value is not None and value > 0) if self.positive else value in self.values

    @property
    def group(self) -> str:
        return self.key.split(".")[0]

    def option(self) -> str:
        """e.g. 'parallel=fsdp or expert_fsdp', 'a MoE model (model.num_experts > 0)'."""
        if self.positive:
            return f"{self.what} ({self.key} > 0)" if self.what else f"{self.key} > 0"
        return self.what or f"{self.group}={' or '.join(map(str, self.values))}"

    def first(self) -> str:
        """The option to suggest: its first value (or `what`, for a key that is no group's
        option: parallel.comm_hook=powersgd)."""
        return f"{self.group}={self.values[0]}" if self.values and not self.what \
            else self.option()


@dataclass(frozen=True)
class Knob:
    doc: str  # one line: what it does (shown by --help)
    choices: tuple | None = None  # allowed values of a string key
    read_by: tuple = ()  # Reads, any of which holds where the key is read; () = always
    tasks: tuple = ("bench",)  # the tasks that read it (task=comm hashes only its own keys)
    since: Any = NEW  # its value before it existed: left out of the hash at that value
    # where unread, the hash: "default" counts it at its default (setting it splits no row),
    # "drop" leaves it out (it came with that option: muon's keys), "keep" keeps it, and it
    # is refused only where the command line sets it (a dense preset inherits its MoE
    # parent's routing keys); elsewhere an unread key set is refused (surely the other
    # option was meant), unless unread_ok (given to every job of a sweep, as rank settings)
    unread: str = "default"
    unread_ok: bool = False
    off: Any = None  # the value that means "this optimization off" (the table's baseline)

    def read_in(self, task: str) -> bool:
        """Whether `task` reads this key (task=tune_batch's probes are bench runs: it reads
        what bench reads, and its own keys)."""
        return task in self.tasks or task in LIKE_BENCH and "bench" in self.tasks


def knob(default: Any = dataclasses.MISSING, doc: str = "", *, factory=None,
         choices=None, read_by=(), **kw) -> Any:
    """A schema field with its declaration (`Knob`) in the field's metadata."""
    read_by = (read_by,) if isinstance(read_by, Reads) else tuple(read_by)
    meta = {"knob": Knob(doc, tuple(choices) if choices else None, read_by, **kw)}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def group(factory, doc: str, hashed: bool = True, reads_in: tuple = ()) -> Any:
    """A config group's field of the root schema; hashed=False: what it holds does not change
    what is measured (left out of the config hash); reads_in: tasks that read every key of
    it that bench reads (task=infer: the model, its precision, the hardware, the data)."""
    return field(default_factory=factory, metadata={"group": doc, "hashed": hashed,
                                                    "reads_in": tuple(reads_in)})


def declarations(schema) -> dict[str, Knob]:
    """{dotted key: Knob} of every field of a root schema (its groups' fields, then its
    own); a field without a declaration raises."""
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
