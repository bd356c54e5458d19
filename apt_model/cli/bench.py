"""``apt-vb bench``: a short measurement suite per device, side by side, as a table and JSON.

See :mod:`apt_model.bench.suite` for what is measured and how.
"""
from __future__ import annotations

import json
import sys


def add_parser(sub) -> None:
    """Add ``bench`` (alias ``benchmark``, the backend manager's name) to the ``apt-vb`` sub-parsers."""
    b = sub.add_parser("bench", aliases=["benchmark"], help="GEMM, elementwise, normalization, attention, transfer and disk speed per device",
                       description="Measure each device briefly (medians with quartiles), side by side.")
    b.add_argument("--device", action="append", default=None, metavar="DEVICE",
                   help="a device to measure (repeatable, or comma-separated); default: the CPU and every accelerator")
    b.add_argument("--duration", type=float, default=30.0, metavar="S", help="seconds for the whole suite (default 30)")
    b.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads for the run (default: torch's current count); recorded in the output")
    b.add_argument("--group", action="append", default=None, metavar="GROUP",
                   help="only these groups (repeatable): gemm, elementwise, norm, attention, transfer, disk")
    b.add_argument("--no-disk", action="store_true", help="skip the disk measurement")
    b.add_argument("--swap-dir", default=None, help="measure this folder's disk (default: VB_SWAP_DIR or the temp folder)")
    b.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON to FILE ('-' for stdout only)")


#: How the suite's argument errors name them: by the flag typed (``--duration=nan must be ...``).
FLAGS = {"duration": "--duration", "threads": "--threads", "swap_dir": "--swap-dir"}


def run_bench(args) -> int:
    """Run the suite, print the table (or JSON with ``--json -``), write ``--json FILE``. Returns 0.

    Raises:
        ConfigError: a bad ``--duration``, ``--threads``, ``--group`` or ``--swap-dir``, or a
            ``--json FILE`` that cannot be written, before anything is measured.
    """
    from tqdm.auto import tqdm

    from apt_model.bench.measure import write_json
    from apt_model.bench.suite import check_arguments, format_table, run_suite
    from apt_model.cli.launcher import check_output_path

    groups = tuple(args.group) if args.group else None
    check_arguments(args.duration, args.threads, groups, disk=not args.no_disk, swap_dir=args.swap_dir, names=FLAGS)
    if args.json and args.json != "-":
        check_output_path(args.json, "--json")
    devices = [d.strip() for item in (args.device or []) for d in item.split(",") if d.strip()] or None
    bar = tqdm(total=None, desc="bench", unit="case", file=sys.stderr, disable=None,
               bar_format="{desc}: {n_fmt} cases [{elapsed}]{postfix}")

    def step(label: str) -> None:
        bar.set_postfix_str(label, refresh=False)
        bar.update(1)

    try:
        result = run_suite(devices, args.duration, args.threads, disk=not args.no_disk, swap_dir=args.swap_dir,
                           progress=step, groups=groups)
    finally:
        bar.close()
    if args.json == "-":
        print(json.dumps(result, indent=2, default=str))
        return 0
    print(format_table(result))
    if args.json:
        try:
            write_json(result, args.json)
        except OSError as err:  # checked before the run, so rare (a full disk): one line, not a traceback
            print(f"apt-vb bench: could not write the JSON to {args.json}: {err}", file=sys.stderr)
            return 1
        print(f"JSON: {args.json}")
    return 0
