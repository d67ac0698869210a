"""`pocketllm policy`: print the slice count the active policy picks per row count, starting no rank."""

from __future__ import annotations

import sys

from pocketllm.distributed.policy import OVERLAP_POLICIES, CalibratedPolicy, resolve_policy
from pocketllm.flags import parse_positive_list


def add_arguments(p) -> None:
    p.add_argument("--rows", default="512,1024,2048,4096", help="comma-separated row counts (default 512,1024,2048,4096)")
    p.add_argument("--comm-overlap-slices", help="the rule's ceiling (env POCKETLLM_COMM_OVERLAP_SLICES, alias QWEN_COMM_OVERLAP_SLICES, default 4)")
    p.add_argument("--pin-slices", help="a pinned count (env POCKETLLM_PIN_SLICES)")
    p.add_argument("--overlap-policy", choices=OVERLAP_POLICIES, help="rule (the default) or calibrated (the default when a calibration is given)")
    p.add_argument(
        "--calibration",
        help="show the calibrated policy from this `pocketllm calibrate` file (env POCKETLLM_CALIBRATION); "
        "nothing is checked against this machine, so another machine's calibration can be inspected",
    )


def run(args) -> int:
    rows = parse_positive_list(args.rows, "--rows")
    choice = resolve_policy(args.pin_slices, args.comm_overlap_slices, overlap_policy=args.overlap_policy, calibration=args.calibration)
    if isinstance(choice.policy, CalibratedPolicy):
        print(f"calibrated policy from {choice.policy.source}: {choice.policy.calibration.describe()}", file=sys.stderr)
    if choice.note:
        print(f"note: {choice.note}", file=sys.stderr)
    for r in rows:
        print(f"rows={r} slices={choice.policy.slices_for_rows(r)}")
    return 0
