"""What a person's terminal fits: its width, and tables cut to it.

The terminal view of a table keeps the columns a reader compares first and leaves the rest
to the file that holds them whole (results.md); columns empty in every row are dropped."""
from __future__ import annotations

import shutil
import sys
import threading
import time

EMPTY = ("", "—", "-", "None", "nan")
NARROWEST = 16  # a column that may wrap is not folded narrower than this, or a quarter
# of the terminal


def width(default: int = 100) -> int:
    """The terminal's columns (COLUMNS first); `default` where output is not a terminal."""
    return max(40, shutil.get_terminal_size((default, 24)).columns)


def table(title: str, columns: list[str], rows: list[list[str]], cols: int, *,
          keep: tuple = (), wrap: tuple = (), right: tuple = ()):
    """(a rich Table no wider than `cols`, the names of the columns left out).

    Columns empty in every row are left out unnamed. The rest are taken in order of want,
    each where it still fits: `keep`'s in its order (its first two always), then the
    others from the left. `wrap` columns may fold over lines (to NARROWEST, a quarter of
    `cols` or their longest word), the others never do; `right` ones are right-justified."""
    from rich.table import Table

    idx = [i for i, _ in enumerate(columns)
           if not rows or any(str(r[i]).strip() not in EMPTY for r in rows)]
    rank = {i: keep.index(c) if c in keep else len(keep) + i
            for i, c in enumerate(columns)}

    def need(i: int, whole: bool) -> int:
        w = max([len(columns[i])] + [len(str(r[i])) for r in rows])
        if columns[i] not in wrap:
            return w
        word = max((len(x) for r in rows for x in str(r[i]).split()), default=0)
        return min(w, max(NARROWEST, cols // 4, min(word, cols // 2) if whole else 0))

    def choose(whole: bool) -> list[int]:
        chosen = []
        for i in sorted(idx, key=rank.get):  # the most wanted first, each where it fits
            if rank[i] < 2 or sum(need(j, whole) + 3 for j in chosen + [i]) + 1 <= cols:
                chosen.append(i)
        return chosen

    # words kept whole, unless that leaves out a column of `keep` that fits otherwise
    chosen, narrow = choose(True), choose(False)
    if {i for i in narrow if columns[i] in keep} > {i for i in chosen if columns[i] in keep}:
        chosen = narrow
    dropped = [columns[i] for i in sorted(idx, key=rank.get) if i not in chosen]
    idx = sorted(chosen)
    t = Table(title=title)
    for i in idx:
        t.add_column(columns[i], justify="right" if columns[i] in right else "left",
                     no_wrap=columns[i] not in wrap,
                     overflow="fold" if columns[i] in wrap else "ellipsis")
    for r in rows:
        t.add_row(*[str(r[i]) for i in idx])
    return t, dropped


def cut(line: str, cols: int) -> str:
    """A line cut to `cols` characters, its end marked."""
    return line if len(line) <= cols else line[:cols - 1] + "…"


def console(cols: int | None = None):
    """A rich Console at `cols` (the terminal's width), without rich's number colouring."""
    from rich.console import Console

    return Console(width=cols or width(), highlight=False)


def wrapped(text: str, cols: int | None = None, indent: str = "  ") -> str:
    """`text` wrapped to the terminal, its later lines indented."""
    import textwrap

    return "\n".join(textwrap.wrap(text, cols or width(), subsequent_indent=indent,
                                    break_on_hyphens=False, break_long_words=False))


def command(line: str, cols: int | None = None) -> str:
    """An indented command cut to the terminal at spaces, each cut a shell's ` \\`: it
    still pastes as one command."""
    import textwrap

    import shlex

    indent, room = line[:len(line) - len(line.lstrip())], (cols or width()) - len(line) \
        + len(line.lstrip()) - 6
    try:  # (a quoted argument stays whole)
        words = shlex.split(line, posix=False)
    except ValueError:
        words = line.split()
    parts = [""]
    for w in words:
        if parts[-1] and len(parts[-1]) + 1 + len(w) > room:
            parts.append(w)
        else:
            parts[-1] = f"{parts[-1]} {w}" if parts[-1] else w
    return " \\\n".join(indent + ("    " if i else "") + p for i, p in enumerate(parts))


def text(markdown: str, cols: int | None = None) -> str:
    """A report's markdown lines for the terminal: prose wrapped, indented commands cut
    as command() cuts them."""
    return "\n".join(command(line, cols) if line.startswith("    ") else
                     wrapped(line, cols) if line else "" for line in markdown.splitlines())


def show(t, dropped: list[str], cols: int, where: str = "") -> None:
    """Print a table from table() at `cols` columns, and a line naming what it left out."""
    console(cols).print(t)
    if dropped:
        print(cut(f"({where + ', ' if where else ''}not shown here: {', '.join(dropped)})",
                  cols))


class Status:
    """A wait's one line, once it has lasted `after` seconds (5 on a terminal, 20 in a
    log): what it waits for, its phase (phase()) and the seconds so far. On a terminal the
    line is redrawn each second and cleared at the end; in a log, a line when the phase
    has changed, at most every 10 s."""
    current: "Status | None" = None

    def __init__(self, what: str, after: float | None = None, stream=None) -> None:
        self.stream = stream or sys.stderr
        self.what, self.phase = what, ""
        self.after = after if after is not None else 5.0 if self.stream.isatty() else 20.0
        self.drawn = 0

    def __enter__(self) -> "Status":
        self.t0, self.stop = time.monotonic(), threading.Event()
        self.prev, Status.current = Status.current, self
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()
        Status.current = self.prev
        if self.drawn:
            self._write("\r" + " " * self.drawn + "\r")

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):  # (a closed stream: the wait goes on unsaid)
            self.stop.set()

    def _cols(self) -> int:
        import os

        try:  # (the stream's terminal: stdout may be redirected)
            return os.get_terminal_size(self.stream.fileno()).columns
        except (OSError, ValueError, AttributeError):
            return width()

    def _run(self) -> None:
        tty = self.stream.isatty()
        said, said_at = None, 0.0
        while not self.stop.wait(1.0 if tty else 0.5):
            s = time.monotonic() - self.t0
            if s < self.after or Status.current is not self:  # (an inner wait speaks)
                continue
            text = f"{self.what}: {self.phase}" if self.phase else self.what
            if tty:
                line = f"{text} ({s:.0f} s)"[:self._cols() - 1]
                self._write("\r" + line.ljust(self.drawn))
                self.drawn = len(line)
            elif (text != said and s - said_at >= 10) or said is None:
                self._write(f"{text} ({s:.0f} s so far)\n")
                said, said_at = text, s


def phase(text: str) -> None:
    """The phase the wait of the innermost Status is in; nothing where none is shown."""
    if Status.current is not None:
        Status.current.phase = text


class Ticking:
    """Redraws a tqdm bar every second (every 10 off a terminal) while a long first step
    runs, so its elapsed time moves: tqdm redraws only when a step ends."""

    def __init__(self, bar, every: float | None = None) -> None:
        self.bar, self.stop = bar, threading.Event()
        every = every or (1.0 if sys.stderr.isatty() else 10.0)
        self.thread = threading.Thread(target=self._run, args=(every,), daemon=True)
        self.thread.start()

    def _run(self, every: float) -> None:
        while not self.stop.wait(every):
            try:
                with self.bar.get_lock():  # (released however the redraw ends)
                    self.bar.refresh(nolock=True)
            except (OSError, ValueError):  # (a closed stream)
                return

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
