"""Run every ``benchmarks/bench_*.py`` and store what each printed, for ``make docs`` to render.

Each benchmark prints one JSON object (its figures, each a ratio or a rate against a baseline measured in the
same run). This script keeps that object as ``benchmarks/results/<name>.json`` together with when it ran and
the machine's load at the time, so that the README's benchmark table is written from a real run and says under
what load. ``bench_plan.py`` stores its own, richer file (``--save``) and is run that way.

Usage: ``python scripts/run_benches.py [NAME ...] [--timeout S]`` (no names: all of them).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BENCH_DIR = ROOT / "benchmarks"
RESULTS = BENCH_DIR / "results"


def last_json_object(text: str) -> dict[str, Any] | None:
    """The last JSON object ``text`` ends with, on one line or indented over several (benchmarks may log before it)."""
    lines = text.strip().splitlines()
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith("{"):
            for chunk in (lines[i], "\n".join(lines[i:])):
                try:
                    obj = json.loads(chunk)
                except json.JSONDecodeError:
                    continue
                if isinstance(obj, dict):
                    return obj
    return None


def run_one(path: Path, timeout_s: float) -> dict[str, Any]:
    """Run one benchmark; the stored record (figures, or why there are none)."""
    name = path.stem
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    args = [sys.executable, str(path)] + (["--save"] if name == "bench_plan" else [])
    try:
        proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s, check=False)
        out, err, rc = proc.stdout, proc.stderr or "", proc.returncode
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        rc = None
    figures = last_json_object(out)
    record: dict[str, Any] = {
        "bench": name, "ran_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "wall_s": round(time.perf_counter() - t0, 1), "returncode": rc,
        "load_average_1min": {"start": round(load0, 2), "end": round(os.getloadavg()[0], 2)},
        "figures": figures,
    }
    if figures is None:
        record["error"] = "timed out" if rc is None else f"printed no JSON object (exit {rc})"
    if rc != 0 and err.strip():
        record["stderr_tail"] = err.strip()[-2000:]  # why it failed, kept with the record
    return record


def main(argv: list[str]) -> int:
    """Run the benchmarks named in ``argv`` (all without names) and write their records."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", help="bench names (bench_runtime or runtime); default: all")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per benchmark")
    args = ap.parse_args(argv)
    wanted = {n if n.startswith("bench_") else f"bench_{n}" for n in args.names}
    RESULTS.mkdir(exist_ok=True)
    failed = 0
    for path in sorted(BENCH_DIR.glob("bench_*.py")):
        if wanted and path.stem not in wanted:
            continue
        record = run_one(path, args.timeout)
        target = RESULTS / f"{path.stem}.run.json"
        target.write_text(json.dumps(record, indent=1) + "\n")
        status = record.get("error") or f"{len(record['figures'])} figures"
        sys.stderr.write(f"{path.stem}: {status} ({record['wall_s']} s) -> {target.relative_to(ROOT)}\n")
        failed += record.get("error") is not None
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
