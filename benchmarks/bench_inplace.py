"""In-place recovery figures alone (issue 11), for re-measuring them without the rest of ``bench_recovery.py``;
prints ONE JSON object: the same figures ``bench_recovery.py`` reports under the same names (see
``benchmarks/_inplace.py``): ``inplace_recovery_s``, ``inplace_lost_steps``, ``join_s`` (warm spare activated ->
its first trained step), ``join_cold_s`` (fresh process spawned -> its first trained step),
``inplace_vs_restart_goodput``; with pipelined replicas (2 x 2 stages): ``inplace_pp_recovery_s``,
``inplace_pp_vs_dp_recovery``, ``inplace_pp_lost_steps``, ``inplace_pp_join_s``; a replica stopped with its
connections open: ``inplace_hang_recovery_s`` against ``inplace_hang_heartbeat_timeout_s``.

``python benchmarks/bench_inplace.py hang`` runs only the stopped-replica figure.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import warnings
from pathlib import Path

from _inplace import bench_inplace, bench_inplace_hang

warnings.filterwarnings("ignore")


def main() -> None:
    """Run the in-place figures; print one JSON object."""
    with tempfile.TemporaryDirectory(prefix="bench-inplace-", dir=os.environ.get("BENCH_DIR")) as d:
        out = bench_inplace_hang(Path(d)) if sys.argv[1:] == ["hang"] else bench_inplace(Path(d))
    out["cpu_load_1min_end"] = round(os.getloadavg()[0], 2)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
