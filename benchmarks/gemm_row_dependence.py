"""Whether torch's GEMM (oneDNN for bf16 where torch has it) gives a row the same bits whatever
other rows share the call: the rows of a prompt chunk computed in one call against the same rows
packed after other rows (another sequence's chunk, or decode rows) in a bigger call. Prints, per
weight shape and row counts, how many output rows differ in any bit and the largest difference.
The batch-invariant engine never relies on it: each prompt segment runs in calls of its own
(docs/batching.md).

    python benchmarks/gemm_row_dependence.py [--shapes 1024x1024,3072x1024] [--rows 64,512] [--others 1,7,512]
"""

from __future__ import annotations

import torch

from common import Parser, int_list, script


def shape(text: str) -> tuple[int, int]:
    """OUTxIN, each a positive integer."""
    out_f, sep, in_f = text.partition("x")
    if not (sep and out_f.isdigit() and in_f.isdigit() and int(out_f) and int(in_f)):
        raise ValueError(text)
    return int(out_f), int(in_f)


def shape_list(text: str) -> list[tuple[int, int]]:
    return [shape(s) for s in text.split(",")]


shape_list.__name__ = "OUTxIN list"  # argparse: "invalid OUTxIN list value: ..."


@script
def main(argv=None) -> int:
    p = Parser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--shapes", type=shape_list, default="1024x1024,6144x1024,1024x3072", help="weight shapes OUTxIN")
    p.add_argument("--rows", type=int_list(1), default="16,64,512", help="rows of the chunk")
    p.add_argument("--others", type=int_list(1), default="1,8,512", help="rows packed before it")
    # The float dtypes a GEMM takes: an integer one has no randn, and no oneDNN row question.
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}; rows differing / rows (max abs difference)")
    for out_f, in_f in args.shapes:
        w = torch.randn(out_f, in_f, dtype=dtype)
        for rows in args.rows:
            x = torch.randn(rows, in_f, dtype=dtype)
            alone = x @ w.t()
            cells = []
            for others in args.others:
                packed = (torch.cat([torch.randn(others, in_f, dtype=dtype), x]) @ w.t())[others:]
                differ = int((packed != alone).any(dim=1).sum())
                cells.append(f"+{others}: {differ}/{rows} ({(packed.float() - alone.float()).abs().max().item():.2g})")
            print(f"{f'{out_f}x{in_f}':>10} chunk {rows:>4}  " + "  ".join(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
