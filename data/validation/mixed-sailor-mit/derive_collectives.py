"""Print the intra-node all-reduce bus bandwidths the MIT cases state (``network.collective_gb_per_s``).

Usage, from this folder (SAILOR = a checkout of https://github.com/eth-easl/sailor, MIT licence):

    python derive_collectives.py SAILOR

For each node kind and TP degree t: one transformer layer of OPT-350M at micro-batch 2 (fp32, seq 2048) as
Sailor's own runtime timed it (``sailor/Planner/simulations/profiles_tmp.json``: forward and backward
seconds per layer, the 4 TP all-reduces included), less the layer's compute from Aceso's op profile of the
same node (``sailor/Planner/baselines/Aceso/profiler/<GPU>/profiled-data-fp32/OPT-350_mbs2_tp<t>_algo0.csv``,
microseconds per op): every op of the layer, the four ops that hold a TP all-reduce (attention-dense and
MLP-GEMM-2 forward, attention-qkv and MLP-GEMM-1 backward) counted as their GEMM only (half the other
direction's time for a forward op, twice it for a backward one), plus the weight-gradient GEMMs that this
profile's backward column leaves out (each the forward GEMM's time). What remains, over 4 all-reduces of
16 MiB (2 x 2048 x 1024 x 4 B), is nccl-tests' bus bandwidth 2(t-1)/t x bytes / time. Aceso's own
collective profile (``prim_OPT-350_all_reduce_<t>gpus.csv``, ms at 16 MB) is printed beside it.
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

GPUS = {"RTX-3090": "rtx-3090", "Titan-RTX": "titan-rtx", "RTX-2080": "rtx-2080"}
MESSAGE_BYTES = 2 * 2048 * 1024 * 4
AR_FORWARD = ("enc-attention-dense", "enc-MLP-GEMM-2")
AR_BACKWARD = ("enc-attention-qkv", "enc-MLP-GEMM-1")


def bus_gb_per_s(t: int, seconds: float) -> float:
    """nccl-tests' busbw of one all-reduce of ``MESSAGE_BYTES`` over ``t`` ranks taking ``seconds``."""
    return 2.0 * (t - 1) / t * MESSAGE_BYTES / seconds / 1e9


def main(argv: list[str]) -> int:
    """Print one line per node kind and TP degree."""
    if len(argv) != 1:
        sys.stderr.write(__doc__ or "")
        return 2
    root = Path(argv[0])
    layers = json.loads((root / "sailor/Planner/simulations/profiles_tmp.json").read_text())["OPT-350"]
    for gpu, acc in GPUS.items():
        prof = root / "sailor/Planner/baselines/Aceso/profiler" / gpu / "profiled-data-fp32"
        for t in (2, 4, 8):
            with (prof / f"OPT-350_mbs2_tp{t}_algo0.csv").open() as f:
                ops = {r["op_name"]: (float(r["forward-compute"]) / 1e6, float(r["backward-compute"]) / 1e6)
                       for r in csv.DictReader(f) if r["op_name"].startswith("enc-")}
            total = sum(f + b for f, b in ops.values())
            gemm_fwd = {k: ops[k][1] / 2.0 for k in AR_FORWARD} | {k: ops[k][0] for k in AR_BACKWARD}
            in_op_ar = sum(ops[k][0] - gemm_fwd[k] for k in AR_FORWARD) + sum(
                ops[k][1] - 2.0 * gemm_fwd[k] for k in AR_BACKWARD)
            compute = total - in_op_ar + sum(gemm_fwd.values())
            fwd, bwd = layers[gpu]["2"][str(t)]["2"][:2]
            per_ar = (fwd + bwd - compute) / 4.0
            with (prof / f"prim_OPT-350_all_reduce_{t}gpus.csv").open() as f:
                prim_s = {float(r["data_size(MB)"]): float(r["time(ms)"]) / 1e3 for r in csv.DictReader(f)}[16.0]
            sys.stdout.write(
                f"{acc:10s} tp {t}: layer {(fwd + bwd) * 1e3:5.1f} ms, compute {compute * 1e3:5.1f} ms, "
                f"all-reduce {per_ar * 1e3:5.2f} ms = {bus_gb_per_s(t, per_ar):5.2f} GB/s busbw "
                f"(Aceso's collective profile {prim_s * 1e3:5.2f} ms = {bus_gb_per_s(t, prim_s):5.2f})\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
