"""DeepSpeed 0.3's pipeline schedule, replayed on the cost model's stage times (analysis aid, issue 9).

DeepSpeed 0.3's ``TrainSchedule`` (``deepspeed/runtime/pipe/schedule.py``, the copy in DachengLi1/AMP that
AMP's runs used) runs 2(m + p - 1) steps per stage; in each step an even stage does a forward and an odd one a
backward (or the reverse), after exchanging activations / gradients with ONE neighbour: a forward step starts
with ``RecvActivation`` and ``SendGrad`` to the previous stage, a backward step with ``SendActivation`` and
``RecvGrad`` to the next. Every send and receive is a blocking ``broadcast`` in a 2-rank group (``pipe/p2p.py``
forces ``async_op=False``) between instructions that ``wall_clock_breakdown`` timers synchronise: an exchange
starts when both stages reach it and ends, for both, when its bytes have crossed. :func:`replay` plays that
instruction order exactly with given forward / backward / exchange times per stage, so the cost model's
pipeline composition (``costmodel.stage.pipeline_step``: m x the slowest stage + the fill and drain through
the others + 2(m + p - 1) sends) can be checked against the schedule the runs executed.

Usage: .venv/bin/python scripts/deepspeed_schedule.py FOLDER [--extra-on ACCELERATOR]

Per case of FOLDER whose slowest group pipelines: measured and modelled step time, the replayed schedule with the model's
stage and send times (the model's non-pipeline parts added: optimizer, gradient and tied-embedding
all-reduces, cross-group sync), and with ``--extra-on`` the time per micro-batch that would have to be added
to every stage on that accelerator for the replay to reach the measured step (0 where the replay is already
slower). Stage times are split 1:2 between forward and backward (the model's backward is twice the forward).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import numpy as np

from starverse.catalog import load_catalog
from starverse.costmodel import step as S
from starverse.costmodel.group import model_numbers
from starverse.costmodel.shapes import ModelShape, TrainShape
from starverse.costmodel.validate import find_cases, load_case

Op = tuple[str, int]


def stage_program(m: int, p: int, s: int) -> list[Op]:
    """Instructions of stage ``s`` (0-based) of ``p`` for ``m`` micro-batches, in DeepSpeed 0.3's
    ``TrainSchedule.steps`` order: ("recv_act" | "send_grad" | "send_act" | "recv_grad" | "F" | "B", micro-batch)."""

    def micro_batch(step: int) -> tuple[int, bool]:
        # TrainSchedule._step_to_micro_batch and its four helpers
        if step % 2 == 0 and s % 2 == 0:
            return step // 2 - s // 2, True
        if step % 2 == 1 and s % 2 == 1:
            return (step - 1) // 2 - s // 2, True
        if step % 2 == 0:
            return step // 2 - p + (s + 1) // 2, False
        return (step - 1) // 2 - p + 1 + s // 2, False

    def valid(mb: int) -> bool:
        return 0 <= mb < m

    out: list[Op] = []
    prev = -1
    for step in range(2 * (m + p - 1)):
        mb, forward = micro_batch(step)
        if forward:
            if valid(mb) and s > 0:
                out.append(("recv_act", mb))
            if valid(prev) and s > 0:
                out.append(("send_grad", prev))
        else:
            if valid(prev) and s < p - 1:
                out.append(("send_act", prev))
            if valid(mb) and s < p - 1:
                out.append(("recv_grad", mb))
        if valid(mb):
            out.append(("F" if forward else "B", mb))
        prev = mb
    return out


_PARTNER = {"send_act": (1, "recv_act"), "recv_act": (-1, "send_act"),
            "send_grad": (-1, "recv_grad"), "recv_grad": (1, "send_grad")}


def replay(forward: Sequence[float], backward: Sequence[float], act_s: Sequence[float], grad_s: Sequence[float],
           m: int) -> float:
    """Time of one step of the schedule: ``forward[s]`` / ``backward[s]`` per micro-batch on stage s,
    ``act_s[i]`` / ``grad_s[i]`` for an activation / gradient exchange over the hop between stages i and i + 1;
    an exchange starts when both stages reach it and ends for both ``act_s`` / ``grad_s`` later."""
    p = len(forward)
    programs = [stage_program(m, p, s) for s in range(p)]
    clock = [0.0] * p
    pos = [0] * p
    while any(pos[s] < len(programs[s]) for s in range(p)):
        moved = False
        for s in range(p):
            while pos[s] < len(programs[s]):
                op, mb = programs[s][pos[s]]
                if op in ("F", "B"):
                    clock[s] += forward[s] if op == "F" else backward[s]
                    pos[s] += 1
                    moved = True
                    continue
                side, want = _PARTNER[op]
                q = s + side
                if pos[q] >= len(programs[q]) or programs[q][pos[q]] != (want, mb):
                    break
                hop = min(s, q)
                end = max(clock[s], clock[q]) + (act_s[hop] if op.endswith("act") else grad_s[hop])
                clock[s] = clock[q] = end
                pos[s] += 1
                pos[q] += 1
                moved = True
        if not moved:
            raise RuntimeError("the schedule deadlocked")  # never for TrainSchedule's order
    return max(clock)


def _rows(path: str, catalog: object, extra_on: str | None) -> list[str]:
    case = load_case(path)
    plan = case.plan
    _, spec = S._resolve(plan, catalog, case.spec)
    shape = ModelShape.from_spec(spec)
    mn = model_numbers(shape, TrainShape.from_train(plan.train))
    profiles = S.plan_profiles(plan, shape)
    seqs = S._split_batch(plan, catalog, mn, profiles)
    est = S.estimate(plan, catalog, case.spec)
    measured = case.measured.step_time_s
    out = []
    # the group whose step sets the plan's step (groups are data-parallel to each other)
    slowest = int(np.argmax([g.step_time_s for g in est.groups]))
    for gi, g in enumerate(plan.groups):
        if gi != slowest:
            continue
        ev = S._eval_group(plan, gi, g, catalog, mn, seqs[gi], profiles)
        b = ev.best
        stage = ev.costs["stage_mb"][:, b]
        p2p = ev.costs["p2p"][:, b]
        p, m = stage.shape[0], int(ev.m[b])
        if p < 2:
            continue
        composed = m * stage.max() + stage.sum() - stage.max() + 2 * (m + p - 1) * p2p.max()
        rest = float(est.step_time_s) - composed  # optimizer, DP / tied all-reduces, cross-group sync
        accs = [st.accelerator for st in g.expanded_stages()]

        def total(x: float, stage: np.ndarray = stage, p2p: np.ndarray = p2p, m: int = m,
                  accs: list[str] = accs, rest: float = rest) -> float:
            t = stage + np.array([x if a == extra_on else 0.0 for a in accs])
            return replay(t / 3.0, 2.0 * t / 3.0, p2p, p2p, m) + rest

        line = (f"{case.name:44s} g{gi} m={m:2d} measured {measured or float('nan'):6.2f} s  model {est.step_time_s:6.2f} s"
                f"  replayed {total(0.0):6.2f} s")
        if extra_on and measured:
            lo, hi = 0.0, 2.0
            if total(0.0) < measured:
                for _ in range(40):
                    mid = (lo + hi) / 2
                    lo, hi = (mid, hi) if total(mid) < measured else (lo, mid)
            line += f"  extra per micro-batch on {extra_on}: {1e3 * lo:5.0f} ms"
        out.append(line)
    return out


def main(argv: list[str]) -> int:
    """Print one line per pipelined group of every case."""
    extra_on = None
    if "--extra-on" in argv:
        i = argv.index("--extra-on")
        extra_on = argv[i + 1]
        argv = argv[:i] + argv[i + 2:]
    catalog = load_catalog()
    for path in find_cases(argv):
        for line in _rows(path, catalog, extra_on):
            sys.stdout.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
