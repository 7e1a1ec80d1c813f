"""Event simulation of DeepSpeed's pipeline schedule on the nine MIT runs, with Sailor's own layer times.

Usage, from this folder (SAILOR = a checkout of https://github.com/eth-easl/sailor, MIT licence):

    python simulate_schedule.py SAILOR

An analysis aid for docs/costmodel.md (Validation, Sailor), not part of the cost model. Each pipeline runs
the instructions of DeepSpeed 0.16.5's ``TrainSchedule`` (``deepspeed/runtime/pipe/schedule.py``: the
engine Sailor's Dockerfile installs) stage by stage; forward and backward of a stage take the sum of its
layers' times in Sailor's per-layer profile (``sailor/Planner/simulations/profiles_tmp.json``, micro-batch 2,
the stage's GPU and TP degree, TP all-reduces included). A transfer carries one micro-batch's activation
(2 x 2048 x 1024 x 4 B, in 1/t partitions that all leave through the node's NIC) at Sailor's profiled rate
between the two nodes: 0.92 Gbit/s from or to the RTX 3090 node and between kinds, 22.9 Gbit/s between two
nodes of one kind (``sailor/providers/multizone_bandwidths_het.json``), over each node's NIC in each
direction in turn. Two semantics: ``blocking`` (a send and its receive start together and hold both stages
until the data has arrived: rendezvous) and ``eager`` (a send is buffered and the sender goes on; the
receiver waits for the data). The printed step adds the ``red_grads`` Sailor logged with the run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ACT_BYTES = 2 * 2048 * 1024 * 4
SLOW, FAST = 0.92e9 / 8, 22.9e9 / 8
# name: (global batch, pipelines of (GPU, TP, Sailor layers [first, last)), logged red_grads s, logged s/iter)
S3, S2, ST = "RTX-3090", "RTX-2080", "Titan-RTX"
RUNS = {
    "n2-d1": (256, [[(S3, 2, 0, 12), (ST, 2, 12, 26)]], 0.00788, 119.83914),
    "n2-d2": (256, [[(ST, 2, 0, 26)], [(S3, 2, 0, 26)]], 59.15, 91.78),
    "n3-d1": (144, [[(S3, 8, 0, 8), (S2, 8, 8, 17), (ST, 8, 17, 26)]], 5.4637, 59.45533),
    "n4-d1": (256, [[(S3, 8, 0, 5), (S2, 8, 5, 12), (ST, 8, 12, 19), (S2, 8, 19, 26)]], 0.00158, 83.76622),
    "n4-d2": (256, [[(S3, 8, 0, 12), (ST, 8, 12, 26)], [(S2, 8, 0, 12), (S2, 8, 12, 26)]], 7.16698, 66.06712),
    "n4-d4": (256, [[(S3, 8, 0, 26)], [(S2, 8, 0, 26)], [(ST, 8, 0, 26)], [(S2, 8, 0, 26)]], 21.59317, 83.45238),
    "n6-d2": (288, [[(S3, 8, 0, 8), (S2, 8, 8, 17), (S2, 8, 17, 26)], [(S2, 8, 0, 8), (ST, 8, 8, 17), (ST, 8, 17, 26)]],
              5.4637, 59.45533),
    "n6-d3": (288, [[(S3, 8, 0, 12), (ST, 8, 12, 26)], [(S2, 8, 0, 12), (S2, 8, 12, 26)],
                    [(S2, 8, 0, 12), (ST, 8, 12, 26)]], 8.89421, 54.2392),
    "n6-d6": (288, [[(S3, 8, 0, 26)], [(S2, 8, 0, 26)], [(S2, 8, 0, 26)], [(ST, 8, 0, 26)], [(S2, 8, 0, 26)],
                    [(ST, 8, 0, 26)]], 22.63707, 70.78508),
}


def schedule(m: int, p: int, s: int) -> list[tuple[str, int]]:
    """``TrainSchedule.steps()`` of stage ``s``: (instruction, micro-batch) pairs; SA/RA/SG/RG = send/receive
    activation/gradient, F/B = forward/backward."""
    out: list[tuple[str, int]] = []
    prev = -1
    for step in range(2 * (m + p - 1)):
        if step % 2 == s % 2:
            mb, fwd = (step // 2 if step % 2 == 0 else (step - 1) // 2) - s // 2, True
        elif step % 2 == 0:
            mb, fwd = step // 2 - p + (s + 1) // 2, False
        else:
            mb, fwd = (step - 1) // 2 - p + 1 + s // 2, False
        valid = 0 <= mb < m
        if fwd and s > 0:
            out += [("RA", mb)] if valid else []
            out += [("SG", prev)] if 0 <= prev < m else []
        if not fwd and s < p - 1:
            out += [("SA", prev)] if 0 <= prev < m else []
            out += [("RG", mb)] if valid else []
        if valid:
            out.append(("F" if fwd else "B", mb))
        prev = mb
    return out


def simulate(m: int, stages: list[tuple[str, float, float]], eager: bool) -> float:
    """Seconds of one pipeline's schedule; ``stages`` = (GPU, forward s, backward s) per stage."""
    p = len(stages)
    cmds = [schedule(m, p, s) for s in range(p)]
    pos, clock, tx, rx = [0] * p, [0.0] * p, [0.0] * p, [0.0] * p
    arrived: dict[tuple[str, int, int], float] = {}
    while True:
        ready = []
        for s in range(p):
            if pos[s] == len(cmds[s]):
                continue
            op, mb = cmds[s][pos[s]]
            if op in ("RA", "RG"):
                key = (op[1], mb, s)
                if key in arrived:
                    ready.append((max(clock[s], arrived[key]), s))
            elif eager or op in ("F", "B"):
                ready.append((clock[s], s))
            else:  # blocking send: wait until the receiver has posted the matching receive
                d = s + 1 if op == "SA" else s - 1
                if pos[d] < len(cmds[d]) and cmds[d][pos[d]] == ("RA" if op == "SA" else "RG", mb):
                    ready.append((max(clock[s], clock[d]), s))
        if not ready:
            break
        _, s = min(ready)
        op, mb = cmds[s][pos[s]]
        if op in ("F", "B"):
            clock[s] += stages[s][1 if op == "F" else 2]
        elif op in ("SA", "SG"):
            d = s + 1 if op == "SA" else s - 1
            a, b = stages[s][0], stages[d][0]
            rate = SLOW if S3 in (a, b) or a != b else FAST
            start = max(clock[s], tx[s], rx[d], 0.0 if eager else clock[d])
            tx[s] = rx[d] = start + ACT_BYTES / rate
            arrived[(op[1], mb, d)] = tx[s]
            if not eager:
                clock[s] = clock[d] = tx[s]
                pos[d] += 1
        else:
            clock[s] = max(clock[s], arrived[(op[1], mb, s)])
        pos[s] += 1
    assert all(pos[s] == len(cmds[s]) for s in range(p)), "schedule deadlocked"
    return max(clock)


def main(argv: list[str]) -> int:
    """Print the simulated and the logged step of every run, both semantics."""
    if len(argv) != 1:
        sys.stderr.write(__doc__ or "")
        return 2
    prof = json.loads((Path(argv[0]) / "sailor/Planner/simulations/profiles_tmp.json").read_text())["OPT-350"]
    for name, (gbs, pipes, red, real) in RUNS.items():
        m = gbs // (2 * len(pipes))
        line = f"{name}: logged {real:6.1f} s"
        for eager in (False, True):
            worst = 0.0
            for pipe in pipes:
                stages = []
                for gpu, tp, lo, hi in pipe:
                    times = [prof[gpu]["2"][str(tp)][str(i)] for i in range(lo, hi)]
                    stages.append((gpu, sum(t[0] for t in times), sum(t[1] for t in times)))
                worst = max(worst, simulate(m, stages, eager))
            step = worst + red
            line += f"  {'eager' if eager else 'blocking'} {step:6.1f} s ({step / real - 1:+.0%})"
        sys.stdout.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
