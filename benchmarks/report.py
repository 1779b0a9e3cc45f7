"""What the benchmarks share: their common options, and writing a table into its own marked section
of a docs page, leaving the rest alone."""
from __future__ import annotations

import os
import sys
import time
from typing import Any, Callable

DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs")


def gpt_args(ap: Any, *, d_model: int, layers: int, heads: int, seq_len: int, micro: int) -> None:
    """Add the sizes of the byte-level GPT a benchmark builds (defaults are each benchmark's own)."""
    ap.add_argument("--d-model", type=int, default=d_model)
    ap.add_argument("--layers", type=int, default=layers)
    ap.add_argument("--heads", type=int, default=heads)
    ap.add_argument("--seq-len", type=int, default=seq_len)
    ap.add_argument("--micro", type=int, default=micro, help="rows per device per step")


def output_args(ap: Any, page: str, *, warmup: int | None = None, rounds: int | None = None) -> None:
    """Add the options every section benchmark takes: `--warmup` / `--rounds` (untimed and timed
    steps, where the benchmark times anything), `--out` (the docs page, default docs/`page`) and
    `--no-write` (print only)."""
    if warmup is not None:
        ap.add_argument("--warmup", type=int, default=warmup, help="untimed steps per configuration")
    if rounds is not None:
        ap.add_argument("--rounds", type=int, default=rounds, help="timed steps per configuration")
    ap.add_argument("--out", default=os.path.join(DOCS, page), help=f"the page to write (default docs/{page})")
    ap.add_argument("--no-write", action="store_true", help="print only")


def write_section(path: str, section: str, begin: str, end: str) -> None:
    """Replace the part of `path` between the `begin` and `end` markers with `section` (which
    carries both markers), or append it when the page has none yet."""
    text = open(path).read() if os.path.exists(path) else ""
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + section + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    with open(path, "w") as f:
        f.write(text)


def write_head(path: str, head: str) -> None:
    """Replace the part of `path` before its first section marker (`<!-- ...`) with `head`, so the
    page's own benchmark keeps the sections the others wrote."""
    text = open(path).read() if os.path.exists(path) else ""
    at = text.find("\n<!-- ")
    rest = text[at:] if at >= 0 else ""
    with open(path, "w") as f:
        f.write(head.rstrip("\n") + "\n" + rest)


def run_section(argv: list[str] | None, parse_args: Callable[[list[str] | None], Any],
                measure: Callable[[Any], Any], render: Callable[[Any, Any, float], str],
                begin: str, end: str, name: str) -> int:
    """A section benchmark's `main`: measure on 8 CPU devices, print the table, and (unless
    `--no-write`) put it into its section of `args.out`."""
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    args = parse_args(argv)
    t0 = time.perf_counter()
    results = measure(args)
    text = render(args, results, time.perf_counter() - t0)
    print(text)
    if not args.no_write:
        write_section(args.out, text, begin, end)
        print(f"wrote the {name} section of {args.out}", file=sys.stderr)
    return 0
