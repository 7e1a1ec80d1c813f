"""Per case of a validation folder: predicted vs measured step time and the model's breakdown
(compute, memory, TP comm, PP bubble, P2P, DP all-reduce), sorted by error. Analysis aid for the cost model.

Usage: .venv/bin/python scripts/breakdown.py FOLDER [--sort error|name]
"""

from __future__ import annotations

import sys

from starverse.catalog import load_catalog
from starverse.costmodel.step import estimate
from starverse.costmodel.validate import find_cases, load_case


def main(argv: list[str]) -> int:
    """Print one line per case."""
    sort = "error"
    if "--sort" in argv:
        i = argv.index("--sort")
        sort = argv[i + 1]
        argv = argv[:i] + argv[i + 2:]
    catalog = load_catalog()
    rows = []
    for path in find_cases(argv):
        case = load_case(path)
        est = estimate(case.plan, catalog, case.spec)
        measured_s = case.measured.step_time_s or 0.0
        err = est.tokens_per_s / case.measured.tokens_per_s - 1.0 if case.measured.tokens_per_s else float("nan")
        rows.append((case.name, est, measured_s, err))
    rows.sort(key=(lambda r: r[3]) if sort == "error" else (lambda r: r[0]))
    keys = sorted({k for r in rows for k in r[1].breakdown})
    sys.stdout.write(f"{'case':44s} {'meas s':>7s} {'pred s':>7s} {'err':>6s} " + " ".join(f"{k[:9]:>9s}" for k in keys)
                     + "  mb sched\n")
    for name, est, ms, err in rows:
        g = est.groups[0]
        sys.stdout.write(f"{name:44s} {ms:7.3f} {est.step_time_s:7.3f} {err:+6.0%} "
                         + " ".join(f"{est.breakdown.get(k, 0.0):9.3f}" for k in keys)
                         + f"  {g.micro_batch} {g.schedule}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
