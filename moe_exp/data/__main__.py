"""`python -m moe_exp.data prepare <text files...> <out.bin>`: make a token file."""
from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

from ..config import TrainConfig
from .tokens import meta_path, path_override, prepare


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m moe_exp.data")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="command (prepare)")
    p = sub.add_parser("prepare", help="byte-level token file from text files (vocab 256)")
    p.add_argument("inputs", nargs="+", help="text files to read")
    p.add_argument("out", help="token file to write (metadata goes to <out>.json)")
    p.add_argument("--force", action="store_true", help="overwrite an existing file that is "
                   "not a token file (one without its .json)")
    args = ap.parse_args(argv)
    try:
        return _prepare(args)
    except OSError as e:  # a path the system refuses in the checks (ELOOP, EACCES, ...)
        print(f"error: {e.filename}: {e.strerror}", file=sys.stderr)
        return 2


NAME_MAX = 255  # bytes in a file name (Linux, macOS)


def _short(path: str) -> str:
    return path if len(path) <= 60 else f"{path[:40]}...{path[-12:]}"


def _name_error(args) -> str | None:
    """The error line for a file name longer than the system takes; None if all fit.

    The output's name counts with its .json suffix. Checked first: the later checks would
    raise OSError on such a name.
    """
    out = Path(args.out)
    if len(meta_path(out).name.encode()) > NAME_MAX:
        return (f"the output {_short(args.out)}: a file name of {len(out.name.encode())} bytes; "
                f"at most {NAME_MAX - len('.json')} (its metadata goes to <name>.json beside "
                "it)")
    for f in [*args.inputs, args.out]:
        if long := [p for p in Path(f).parts if len(p.encode()) > NAME_MAX]:
            return (f"{_short(f)}: a name of {len(long[0].encode())} bytes; a file or dir name "
                    f"is at most {NAME_MAX}")
    return None


def _prepare(args) -> int:
    if line := _name_error(args):
        print(f"error: {line}", file=sys.stderr)
        return 2
    for what, bad in (("no such file", [f for f in args.inputs if not Path(f).exists()]),
                      ("a directory, not a text file", [f for f in args.inputs
                                                        if Path(f).is_dir()]),
                      ("not a regular file", [f for f in args.inputs if Path(f).exists()
                                              and not Path(f).is_dir()
                                              and not Path(f).is_file()])):
        if bad:
            print(f"error: {what}: {', '.join(bad)}", file=sys.stderr)
            return 2
    times = Counter(Path(f).resolve() for f in args.inputs)
    twice = sorted({f for f in args.inputs if times[Path(f).resolve()] > 1})
    if twice:
        print(f"warning: given more than once (their text is in the file that often): "
              f"{', '.join(twice)}", file=sys.stderr)
    if not any(Path(f).stat().st_size for f in args.inputs):  # (the file would hold only
        # separators, every window of which is the same token)
        print(f"error: the inputs hold no text: {', '.join(args.inputs)}", file=sys.stderr)
        return 2
    out = Path(args.out)
    clash = [f for f in args.inputs
             if Path(f).resolve() in (out.resolve(), meta_path(out).resolve())]
    if clash:  # writing it would empty it before it is read
        print(f"error: the output {args.out} (or its .json) is also an input: {', '.join(clash)}",
              file=sys.stderr)
        return 2
    if out.exists() and not out.is_dir() and not out.is_file():  # /dev/null, a pipe
        print(f"error: the output {args.out} is not a regular file; give a file name",
              file=sys.stderr)
        return 2
    if out.is_dir():
        print(f"error: the output {args.out} is a directory; give a file name (e.g. "
              f"{out / 'corpus.bin'})", file=sys.stderr)
        return 2
    if out.is_file() and not meta_path(out).is_file() and not args.force:  # an output
        # left off the command line would make the last input the output
        print(f"error: the output {args.out} exists and is not a token file (no "
              f"{meta_path(out).name} beside it): was it meant as an input? Name a new file, "
              "or add --force to overwrite it", file=sys.stderr)
        return 2
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        meta = prepare(args.inputs, args.out)
    except OSError as e:
        for f in (out, meta_path(out)):  # (a file cut short is no token file)
            if f.is_file():
                f.unlink(missing_ok=True)
        reading = e.filename is not None and Path(e.filename) in map(Path, args.inputs) \
            and Path(e.filename) != out.parent
        print(f"error: could not read {e.filename}: {e.strerror}" if reading else
              f"error: could not write {args.out}: " + (f"{e.filename}: {e.strerror}"
                                                         if e.filename else str(e)),
              file=sys.stderr)
        return 2
    print(f"wrote {args.out}: {meta['num_tokens']:,} tokens (vocab {meta['vocab_size']}); "
          f"use: python -m moe_exp.run data=tokens {path_override(args.out)}")
    seq = TrainConfig.seq_len
    if meta["num_tokens"] < seq + 1:
        print(f"warning: {meta['num_tokens']} tokens: a run needs more than train.seq_len "
              f"(default {seq}) of them; add text or lower train.seq_len", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
