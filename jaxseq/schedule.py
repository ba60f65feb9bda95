"""`python -m jaxseq.schedule --pipe 4 --microbatches 8 [--virtual-stages 2] [--schedule 1f1b] [--layers L]`:
print a pipeline schedule's per-stage timeline and its bubble (`jaxseq.parallel.schedule`)."""

from __future__ import annotations

import sys

from jaxseq import cli
from jaxseq.config import SCHEDULES
from jaxseq.parallel.schedule import Schedule


def main(argv=None) -> int:
    ap = cli.ArgumentParser(prog="python -m jaxseq.schedule",
                            description="Print a pipeline schedule's per-stage timeline and its bubble.")
    ap.add_argument("--pipe", type=int, required=True, help="pipeline stages p")
    ap.add_argument("--microbatches", type=int, required=True, help="micro-batches per step m")
    ap.add_argument("--virtual-stages", type=int, default=1,
                    help="chunks per stage v (interleaved, or zb-h1 over v chunks)")
    ap.add_argument("--schedule", default="1f1b", help=f"one of {', '.join(SCHEDULES)} (default 1f1b)")
    ap.add_argument("--layers", type=int, help="model layers, to print each chunk's layers")
    args = ap.parse_args(argv)
    return cli.run(lambda: _print(args))


def _print(args) -> int:
    sched = Schedule.make(args.schedule, args.pipe, args.microbatches, args.virtual_stages, args.layers)
    print(sched.summary())
    if args.layers:
        for s in range(sched.p):
            print(f"stage {s} layers: " + "; ".join(
                f"chunk {c}: {sched.layers_of(s, c, args.layers)}" for c in range(sched.v)))
    print("timeline (F/B<micro-batch>[.<chunk>], '.' idle):")
    print(sched.render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
