"""`python -m moe_exp.data prepare <text files...> <out.bin>`: make a token file."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .tokens import meta_path, prepare


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m moe_exp.data")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="byte-level token file from text files (vocab 256)")
    p.add_argument("inputs", nargs="+", help="text files to read")
    p.add_argument("out", help="token file to write (metadata goes to <out>.json)")
    p.add_argument("--force", action="store_true", help="overwrite an existing file that is "
                   "not a token file (one without its .json)")
    args = ap.parse_args(argv)
    missing = [f for f in args.inputs if not Path(f).is_file()]
    if missing:
        print(f"error: no such file: {', '.join(missing)}", file=sys.stderr)
        return 2
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
    meta = prepare(args.inputs, args.out)
    print(f"wrote {args.out}: {meta['num_tokens']:,} tokens (vocab {meta['vocab_size']}); "
          f"use: python -m moe_exp.run data=tokens data.path={args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
