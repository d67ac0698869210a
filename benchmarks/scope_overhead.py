"""What the profiling scopes cost when no profile is on: `pocketllm bench` on this tree against
the same tree with every `with scope(...)` stripped out, interleaved rep-major (the order reversed
every other rep), plus the cost of one disabled scope.

    python benchmarks/scope_overhead.py [--reps 6] [bench flags, e.g. --preset small --tp-world 2]

The stripped copy is made in a temporary directory (bodies dedented, scope imports and the
collective scopes' timed.* calls dropped); each tree's bench runs from inside that tree with it on
PYTHONPATH, so both trees run the same command in fresh processes.
"""

from __future__ import annotations

import json
import re
import shutil
import statistics
import sys
import tempfile
import timeit
from pathlib import Path

from common import Parser, alternate, even_reps, run_bench_json, script, spread

REPO = Path(__file__).resolve().parents[1]
_IMPORT = re.compile(r"^from pocketllm\.profiling\.scopes import (.+)$", re.MULTILINE)
_WITH = re.compile(r"^(\s*)with scope\(.*\)( as \w+)?:\s*$", re.MULTILINE)
_TIMED = re.compile(r"^\s*timed\.(settle|wait_for_peers)\(")


def _strip_once(lines: list[str]) -> list[str]:
    out, i = [], 0
    while i < len(lines):
        m = _WITH.match(lines[i])
        if m:
            indent = len(m.group(1))
            i += 1
            while i < len(lines) and (not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > indent):
                out.append(lines[i][4:] if lines[i].strip() else lines[i])
                i += 1
            continue
        imported = _IMPORT.match(lines[i])
        if imported:
            # Only `scope` leaves the import; any other name it brings stays.
            rest = [n.strip() for n in imported.group(1).split(",") if n.strip() != "scope"]
            if rest:
                out.append(f"from pocketllm.profiling.scopes import {', '.join(rest)}\n")
        elif not _TIMED.match(lines[i]):
            out.append(lines[i])
        i += 1
    return out


def scoped_modules(package: Path) -> list[str]:
    """The modules (relative to `package`) that import `scope`: the ones whose code holds scopes."""
    found = []
    for path in sorted(package.rglob("*.py")):
        for names in _IMPORT.findall(path.read_text()):
            if "scope" in (n.strip() for n in names.split(",")):
                found.append(path.relative_to(package).as_posix())
                break
    return found


def stripped_tree(dest: Path) -> Path:
    shutil.copytree(REPO / "pocketllm", dest / "pocketllm", ignore=shutil.ignore_patterns("__pycache__"))
    for rel in scoped_modules(dest / "pocketllm"):
        path = dest / "pocketllm" / rel
        lines = path.read_text().splitlines(keepends=True)
        # Nested scopes come out one level per pass.
        while (new := _strip_once(lines)) != lines:
            lines = new
        text = "".join(lines)
        if "scope(" in text:
            raise SystemExit(f"could not strip every scope from {rel}")
        path.write_text(text)
    # A scope in a module the import pattern missed (a parenthesised import, say) would stay in
    # both trees and hide its cost: refuse rather than measure that.
    left = [p.relative_to(dest).as_posix() for p in (dest / "pocketllm").rglob("*.py") if _WITH.search(p.read_text())]
    if left:
        raise SystemExit(f"scopes left in the stripped copy: {', '.join(left)}")
    return dest


def disabled_scope_ns() -> float:
    from pocketllm.profiling.scopes import installed, scope

    assert installed() is None

    def scoped():
        with scope("norms", "input"):
            pass

    def bare():
        pass

    n = 200_000
    with_scope = min(timeit.repeat(scoped, number=n, repeat=5)) / n
    without = min(timeit.repeat(bare, number=n, repeat=5)) / n
    return (with_scope - without) * 1e9


def bench(tree: Path, bench_args: list[str]) -> dict:
    # Run from inside the tree as well as with it on PYTHONPATH: `-m` puts the working directory
    # first on sys.path, so only then does `pocketllm` come from that tree rather than this one.
    return run_bench_json(bench_args, env={"PYTHONPATH": str(tree)}, cwd=tree)


@script
def main(argv=None) -> int:
    p = Parser(description=" ".join(__doc__.split("\n\n")[0].split()), epilog="Any other flag goes to `pocketllm bench` (e.g. --ckpt DIR --max-new-tokens 64).")
    p.add_argument("--reps", type=even_reps, default=6, help="reps per tree, even so each runs first as often (default 6)")
    args, bench_args = p.parse_known_args(argv)
    print(f"one disabled scope: {disabled_scope_ns():.0f} ns")
    with tempfile.TemporaryDirectory(prefix="pocketllm-noscope-") as tmp:
        trees = {"scopes, profiles off": REPO, "scopes stripped": stripped_tree(Path(tmp))}
        results = {name: [] for name in trees}
        for rep in range(args.reps):
            for name in alternate(list(trees), rep):
                results[name].append(bench(trees[name], bench_args))
            print(f"rep {rep + 1}/{args.reps} done", file=sys.stderr, flush=True)
    print(f"pocketllm bench {' '.join(bench_args)}: {args.reps} reps interleaved, median (min..max)")
    medians = {}
    for name, runs in results.items():
        pre = [r["prefill_tokens_per_s"] for r in runs]
        dec = [r["decode_tokens_per_s"] for r in runs]
        medians[name] = (statistics.median(pre), statistics.median(dec))
        print(f"  {name:22s} prefill TPS {spread(pre)}   decode TPS {spread(dec, 2)}")
    (p_on, d_on), (p_off, d_off) = medians.values()
    print(json.dumps({"prefill_ratio_with_to_without": round(p_on / p_off, 4), "decode_ratio_with_to_without": round(d_on / d_off, 4)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
