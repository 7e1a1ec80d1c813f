"""Random-kill soak, ``recovery: in-place`` (torchft replicas, ``elastic/inplace.py``): one run, ``NUM_KILLS``
SIGKILLs of random replicas in the middle of a step, some of them **while a replacement is joining**; no restart.

The kills are file markers (``soak-inplace/kill-N.json``) consumed in order by the replica that executes them (an
``unlink`` only one process wins), so each fires exactly once whatever process (original or replacement) holds the
rank: a ``full`` kill fires when every replica took part in the last step (its target is alive), a ``joining`` kill
fires on a survivor while a replacement has not joined yet (exactly one replica missing in the last step; each
comes right after a "full" kill: two replicas missing at once may rejoin together, never leaving exactly one
missing). A kill waits until the last recorded step postdates the previous one. While a replica is
missing, steps are slowed (``WaitForReplicas``) so replacements join; once every kill fired and every replica is
back, the leader asks the run to stop. Replacements are warm spares when one is ready (the first one always is),
else fresh processes. Checked as the restart soak (``test_soak.py``): the run finishes in one
attempt with every kill a loss and every loss a join, committed checkpoints load, the ledger checks (lost leases
ended at the loss), and the final weights equal an uninterrupted run's of as many steps (``assert_close``).
"""

from __future__ import annotations

import json
import os
import random
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("torchft", reason="recovery: in-place needs torchft (the train extra)")
from test_soak import FIT, OPTS, _cluster, _job, _load_committed, _model, _seed

from helpers import ramp_tokens
from starverse.billing import Ledger, check_ledger
from starverse.elastic.inplace import InplaceLauncher
from starverse.elastic.job import job_prices, load_job
from starverse.elastic.supervisor import Supervisor
from starverse.jobs import build_callbacks
from starverse.jobs.ledger import InplaceAccounting
from starverse.metrics.callbacks import lease_pricing
from starverse.runtime.callbacks import Callback
from starverse.runtime.ft import INPLACE_LOG
from starverse.runtime.trainer import Trainer
from starverse.testing import WaitForReplicas

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

NUM_KILLS = 5
NUM_REPLICAS = 3
MAX_STEPS = 2000  # a bound only: the run stops once every kill fired and every replica is back
KILLS_DIR = "soak-inplace"
REPLACE_AFTER_S = 1.0


@dataclass
class MarkedKills(Callback):
    """Every replica: SIGKILL this process mid-step when it wins the next kill marker (see the module docstring)."""

    folder: str
    num_replicas: int

    def on_micro_batch_end(self, ctx: Any, compute_s: float) -> None:
        markers = sorted(Path(self.folder).glob("kill-*.json"))
        if not markers:
            return
        try:
            ev = json.loads(markers[0].read_text())
        except (OSError, ValueError):
            return
        # the last step recorded must postdate the previous kill, so its membership counts that loss (the
        # previous kill's winner writes fired-N after claiming its marker: until then the next one waits)
        index = int(markers[0].stem.split("-")[1])
        if index > 0:
            try:
                fired_step = int((Path(self.folder) / f"fired-{index - 1}").read_text())
            except (OSError, ValueError):
                return
            if ctx.step < fired_step:
                return
        members = len(ctx.metrics.shares)
        full = members == self.num_replicas
        rank = int(os.environ.get("RANK", "-1"))
        if ev["kind"] == "full" and not (full and rank == ev["rank"] and ctx.step + 1 >= ev["after_step"]):
            return
        # while exactly one replica is missing (a replacement on its way), so that a survivor always remains
        if ev["kind"] == "joining" and (members != self.num_replicas - 1 or rank == ev["not_rank"]):
            return
        try:
            markers[0].unlink()  # one process wins the marker
        except FileNotFoundError:
            return
        tmp = Path(self.folder) / f".fired-{index}.{os.getpid()}"
        tmp.write_text(str(ctx.step + 1))  # the step in flight: the survivors record it without this replica
        tmp.replace(Path(self.folder) / f"fired-{index}")
        os.kill(os.getpid(), signal.SIGKILL)


@dataclass
class StopWhenDone(Callback):
    """The leader: stop the run once every kill fired and every replica took part in the last step."""

    folder: str
    num_replicas: int

    def on_step_end(self, ctx: Any) -> None:
        if not any(Path(self.folder).glob("kill-*.json")) and len(ctx.metrics.shares) == self.num_replicas:
            ctx.request_stop("soak: every kill fired, every replica is back")


@dataclass
class StopAt(Callback):
    """Stop at the end of ``step`` (the uninterrupted run: same ``max_steps``, so the same learning-rate schedule)."""

    step: int

    def on_step_end(self, ctx: Any) -> None:
        if ctx.step >= self.step:
            ctx.request_stop("the soak's last step")


def _arm(folder: Path, seed: int) -> list[dict[str, Any]]:
    """Write the kill markers: at least two while a replica joins, each right after a "full" kill (a joining kill
    needs exactly one replica missing; after two at once the replacements may join together, never leaving one
    missing for a second joining kill)."""
    rng = random.Random(seed)
    patterns = [k for k in ("FJFJF", "FJFFJ", "FFJFJ") if len(k) == NUM_KILLS]
    kinds = ["full" if c == "F" else "joining" for c in rng.choice(patterns)]
    folder.mkdir(parents=True)
    events, last = [], -1
    for i, kind in enumerate(kinds):
        if kind == "full":
            last = rng.randrange(NUM_REPLICAS)
            ev = {"kind": kind, "rank": last, "after_step": rng.randint(2, 4)}
        else:  # a survivor of the last kill (any other rank is alive while that one rejoins)
            ev = {"kind": kind, "not_rank": last}
            last = -1  # which survivor dies is who gets there first: the next "joining" kill may hit anyone alive
        events.append(ev)
        (folder / f"kill-{i}.json").write_text(json.dumps(ev))
    return events


@pytest.mark.timeout(900)
def test_soak_local_launcher_inplace(tmp_path):
    seed = _seed()
    why = f"seed {seed}, launcher local, recovery in-place"
    job = load_job(_job(tmp_path, NUM_REPLICAS))
    wiring = build_callbacks(job, mtbf_s=3600.0, prices=job_prices(job, ["cpu"] * NUM_REPLICAS))
    kills = Path(job.run_dir) / KILLS_DIR
    events = _arm(kills, seed)
    # replacements are the launcher's warm spares when one is ready (else fresh processes); 1 s after a loss, so
    # that at least one step runs with that replica missing (a "joining" kill needs one)
    launcher = InplaceLauncher(replace_after_s=REPLACE_AFTER_S)
    billing = wiring.billing
    assert billing is not None and billing.ledger_path is not None
    cluster = _cluster(NUM_REPLICAS)
    prices = billing.prices
    accounting = InplaceAccounting(Path(billing.ledger_path), billing.job_name or "run", Path(job.run_dir),
                                   lambda acc: lease_pricing(prices, cluster.plan, acc))
    launcher.on_loss, launcher.on_join = accounting.on_loss, accounting.on_join
    extra = [MarkedKills(str(kills), NUM_REPLICAS), WaitForReplicas(NUM_REPLICAS, after_step=0, pause_s=0.3),
             StopWhenDone(str(kills), NUM_REPLICAS)]
    sup = Supervisor(cluster, job.run_dir, checkpoint=wiring.checkpoint, preemption=wiring.preemption,
                     callbacks=[*wiring.accounting, *extra],
                     trainer_options={**OPTS, "launcher": launcher, "recovery": "in-place", "timeout_s": 800},
                     max_restarts=0)
    model = _model()
    try:
        result = sup.run(lambda c: model, ramp_tokens(), resume_from=None, **{**FIT, "max_steps": MAX_STEPS})
    finally:
        print("soak (in-place) events:", events, "left:", sorted(p.name for p in kills.iterdir()),
              "losses:", [(loss.error.rank, str(loss.error)[:80]) for loss in launcher.losses],
              "joins:", [j.rank for j in launcher.joins])
        log = Path(job.run_dir) / INPLACE_LOG
        print(log.read_text() if log.is_file() else "no in-place log")

    print("soak (in-place):", events, [(loss.error.rank, loss.error.cause) for loss in launcher.losses],
          [j.rank for j in launcher.joins], "steps", result.final_step)
    assert [a.outcome for a in result.attempts] == ["completed"], (why, result.attempts)
    assert not any(kills.glob("kill-*.json")), (why, "a kill never fired", sorted(kills.iterdir()))
    assert len(launcher.losses) == NUM_KILLS and len(launcher.joins) == NUM_KILLS, (why, launcher.losses)
    assert launcher.joins[0].warm, (why, launcher.joins)  # the first replacement: the spare started with the job
    full = [ev["rank"] for ev in events if ev["kind"] == "full"]
    lost = [loss.error.rank for loss in launcher.losses]
    assert [r for r, ev in zip(lost, events, strict=True) if ev["kind"] == "full"] == full, (why, lost, events)
    assert result.final_step < MAX_STEPS, why

    final = model.state_dict()
    committed = _load_committed(sup.store, final)
    assert committed, why
    reference = _model()
    ref = Trainer(_cluster(NUM_REPLICAS), callbacks=[StopAt(result.final_step)], run_dir=tmp_path / "uninterrupted",
                  **OPTS).fit(reference, ramp_tokens(), **{**FIT, "max_steps": MAX_STEPS})
    assert ref.steps == result.final_step, (why, ref.steps)
    for k, v in final.items():
        torch.testing.assert_close(v, reference.state_dict()[k], rtol=1e-4, atol=1e-5,
                                   msg=lambda m, k=k: f"{why}: {k}: {m}")
    with Ledger.open(Path(billing.ledger_path), create=False, read_only=True, check="full") as ledger:
        checked = check_ledger(ledger)
    assert checked.ok, (why, checked.problems)
    assert checked.num_leases >= NUM_REPLICAS + NUM_KILLS, (why, checked)
