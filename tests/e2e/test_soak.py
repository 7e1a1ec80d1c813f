"""Random-kill soak (issue 11, item 6): one run, ``NUM_KILLS`` SIGKILLs of random ranks, with both launchers.

A seeded schedule (the seed is printed; set ``STARVERSE_SOAK_SEED`` to replay one) draws, before each attempt,
which rank dies and when: right after a random step, or **while a checkpoint is being written** (the rank's DCP
writer has written its data, the checkpoint is not committed yet: a file marker arms it, no sleep decides it).
After each loss the supervisor gets either a replacement device of the same kind or re-plans on the survivors
(drawn too). The run is wired as a job is (``build_callbacks``: preemption, checkpoints, the ledger), under the
supervisor, on a plain torch model (ranks start without importing transformers: the soak restarts them often).
Then it checks:

- the run finishes, every scheduled kill happened (one ``lost`` attempt each, naming the killed rank), and a
  kill during a write never left that checkpoint committed (the next attempt resumed from an earlier one);
- no committed checkpoint is torn: every manifest's files match their sizes and checksums and load (DCP model
  state, extras, every rank's RNG state), and the last one holds the final weights;
- the ledger checks (``starverse bill --check``'s library call);
- the run is data-parallel only, so its final weights equal an uninterrupted run's on the same global batches.

``RECOVERY`` lists the recovery modes this soak runs: checkpoint-restart. ``recovery: in-place`` (torchft: no
restart, replacements join live) has its own soak with kills while a replica joins: ``test_soak_inplace.py``.
"""

from __future__ import annotations

import json
import os
import random
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from helpers import RAY_GROUP, SEQ, TinyLM, ramp_tokens
from starverse.billing import Ledger, check_ledger
from starverse.checkpoint.store import CheckpointStore
from starverse.elastic.job import job_prices, load_job
from starverse.elastic.supervisor import Supervisor, replan_local
from starverse.jobs import build_callbacks
from starverse.runtime.callbacks import Callback
from starverse.runtime.cluster import Cluster, local_plan
from starverse.runtime.export import FINAL_WEIGHTS
from starverse.runtime.launch import RankSpec
from starverse.runtime.trainer import Trainer
from starverse.testing import KillRank

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
              pytest.mark.xdist_group(RAY_GROUP)]

NUM_KILLS = 5
STEPS = 14
INTERVAL = 2
GLOBAL_BATCH = 12  # micro-batches of 2: splits over 3 and 2 ranks
FIT = {"per_device_batch_size": 2, "max_steps": STEPS, "seq_len": SEQ}
OPTS = {"rebalance_every": 0, "collective_timeout_s": 60.0}
RECOVERY = ("restart",)
KILL_MARKER = "soak-kill.json"
"""In the checkpoint folder: ``{"rank": r, "step": s}`` arms :class:`KillWhileWriting` for one write."""


class KillWhileWriting(FileSystemWriter):
    """The DCP writer of every rank; the rank and step named by the armed marker SIGKILLs itself once its
    data of that checkpoint is written, before the checkpoint is committed (the marker is consumed first)."""

    def write_data(self, plan: Any, planner: Any) -> Any:
        fut = super().write_data(plan, planner)
        partial = Path(str(self.fs.concat_path(self.path, "")))
        marker = partial.parent / KILL_MARKER
        try:
            armed = json.loads(marker.read_text())
        except (OSError, ValueError):
            return fut
        if (partial.name.startswith(f".partial-step-{armed['step']}-")
                and os.environ.get("RANK") == str(armed["rank"])):
            fut.wait()
            marker.unlink()
            os.kill(os.getpid(), signal.SIGKILL)
        return fut


@dataclass(frozen=True)
class Kill:
    """One scheduled kill."""

    attempt: int
    rank: int
    step: int
    during_write: bool
    resumed_from: int


class Schedule:
    """Draws each attempt's kill from a seeded generator, given where the attempt resumes and its ranks."""

    def __init__(self, seed: int, num_kills: int):
        self.rng = random.Random(seed)
        # at least two of each kind of kill, in a random order
        self.during_write = [True, True, False, False] + [self.rng.random() < 0.5 for _ in range(num_kills - 4)]
        self.rng.shuffle(self.during_write)
        self.kills: list[Kill] = []
        self.sup: Supervisor | None = None

    def callbacks(self, attempt: int) -> list[Callback]:
        """The kill of this attempt (none after the last), drawn when the supervisor starts the attempt."""
        sup = self.sup
        assert sup is not None
        if attempt > len(self.during_write):
            return []
        latest = sup.store.latest()
        resumed = latest.step if latest is not None else 0
        rank = self.rng.randrange(len(sup.cluster.ranks))
        during = self.during_write[attempt - 1]
        if during:  # one of the next two checkpoints, never the final one
            step = min(resumed + INTERVAL * self.rng.randint(1, 2), STEPS - INTERVAL)
            sup.store.root.mkdir(parents=True, exist_ok=True)
            (sup.store.root / KILL_MARKER).write_text(json.dumps({"rank": rank, "step": step}))
        else:
            step = self.rng.randint(resumed + 1, min(resumed + 2 * INTERVAL, STEPS - 1))
        self.kills.append(Kill(attempt, rank, step, during, resumed))
        return [] if during else [KillRank(rank=rank, step=step)]

    def replan(self, cluster: Cluster, survivors: list[RankSpec], lost: list[RankSpec]) -> Cluster:
        """A replacement of the same kind (the cluster unchanged), or a re-plan on the survivors."""
        if len(survivors) >= 2 and self.rng.random() < 0.4:
            return replan_local(cluster, survivors, lost)
        return cluster


def _cluster(num_ranks: int) -> Cluster:
    ranks = tuple(RankSpec(i, "cpu", "cpu", 1) for i in range(num_ranks))
    return Cluster(plan=local_plan(ranks, "tiny", 1, SEQ, GLOBAL_BATCH, precision="fp32"), ranks=ranks)


def _model() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM()


def _job(tmp: Path, num_ranks: int) -> Path:
    """The job whose wiring the soak uses (checkpoint every INTERVAL steps, all kept; priced CPU leases)."""
    (tmp / "pool.yaml").write_text(f"currency: USD\noffers:\n  - {{accelerator: cpu, count: {num_ranks}, "
                                   "price_per_hour: 36}\n")
    (tmp / "unused.txt").write_text("the soak trains on ramp_tokens()")
    job = tmp / "job.yaml"
    job.write_text(
        "model: tiny\ndataset: unused.txt\nrun_dir: run\npool: pool.yaml\n"
        f"checkpoint: {{interval_steps: {INTERVAL}, keep_last: null}}\nmetrics: {{enabled: false}}\n"
    )
    return job


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Callable[[int], dict[str, torch.Tensor]]:
    """The final weights of the run without a kill, per number of ranks (local launcher; Ray's are the same)."""
    done: dict[int, dict[str, torch.Tensor]] = {}

    def weights(num_ranks: int) -> dict[str, torch.Tensor]:
        if num_ranks not in done:
            model = _model()
            Trainer(_cluster(num_ranks), run_dir=tmp_path_factory.mktemp("uninterrupted"), **OPTS).fit(
                model, ramp_tokens(), **FIT)
            done[num_ranks] = {k: v.clone() for k, v in model.state_dict().items()}
        return done[num_ranks]

    return weights


@pytest.fixture(scope="module")
def ray_session():
    """One private loopback Ray session for the Ray soak: its attempts reuse it (the launcher leaves it up)."""
    ray = pytest.importorskip("ray")
    from starverse.providers.ray import _loopback_only

    with _loopback_only(ray):
        ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False, num_cpus=3,
                 object_store_memory=100 * 1024 * 1024, logging_level="WARNING")
        try:
            yield ray
        finally:
            ray.shutdown()


def _seed() -> int:
    seed = int(os.environ.get("STARVERSE_SOAK_SEED") or random.SystemRandom().randrange(2**31))
    print(f"soak seed: {seed} (replay: STARVERSE_SOAK_SEED={seed})")
    return seed


def _load_committed(store: CheckpointStore, like: dict[str, torch.Tensor]) -> dict[int, dict[str, torch.Tensor]]:
    """Every committed checkpoint, checked and loaded: its files match the manifest (sizes, CRC-32), the model
    state loads through DCP, the extras and every rank's RNG state load."""
    out = {}
    for info in store.list():
        store.verify(info)
        sd = {"model": {k: torch.full_like(v, float("nan")) for k, v in like.items()}}
        dcp.load(sd, storage_reader=dcp.FileSystemReader(info.path), no_dist=True)
        torch.load(info.path / "extras.pt", weights_only=True)
        for r in range(info.world_size):
            torch.load(info.path / f"rng-{r}.pt", weights_only=True)
        out[info.step] = sd["model"]
    return out


def _soak(tmp: Path, launcher: str, recovery: str, num_ranks: int, reference: dict[str, torch.Tensor]) -> None:
    assert recovery == "restart"  # the only mode built; in-place (torchft) joins RECOVERY when it lands
    seed = _seed()
    why = f"seed {seed}, launcher {launcher}"
    job = load_job(_job(tmp, num_ranks))
    wiring = build_callbacks(job, mtbf_s=3600.0, prices=job_prices(job, ["cpu"] * num_ranks))
    wiring.checkpoint.writer_factory = KillWhileWriting
    schedule = Schedule(seed, NUM_KILLS)
    sup = Supervisor(
        _cluster(num_ranks), job.run_dir, checkpoint=wiring.checkpoint, preemption=wiring.preemption,
        callbacks=lambda attempt: [*wiring.accounting, *schedule.callbacks(attempt)],
        trainer_options={**OPTS, "launcher": launcher}, max_restarts=NUM_KILLS + 1, replan=schedule.replan,
    )
    schedule.sup = sup
    models: list[TinyLM] = []

    def factory(cluster: Cluster) -> TinyLM:
        models.append(_model())
        return models[-1]

    result = sup.run(factory, ramp_tokens(), resume_from=None, **FIT)

    kills, attempts = schedule.kills, result.attempts
    print(f"soak ({launcher}):", [f"{a.outcome} {a.wall_s:.1f}s" for a in attempts], kills)
    assert len(kills) == NUM_KILLS and result.final_step == STEPS, (why, kills, attempts)
    assert [a.outcome for a in attempts] == ["lost"] * NUM_KILLS + ["completed"], (why, kills, attempts)
    for kill, lost, nxt in zip(kills, attempts, attempts[1:], strict=False):
        assert f"rank {kill.rank} " in lost.detail, (why, kill, lost.detail)
        assert (lost.resumed_from or 0) == kill.resumed_from, (why, kill, lost)
        if kill.during_write:  # killed before that checkpoint committed: the next attempt resumed before it
            assert (nxt.resumed_from or 0) < kill.step, (why, kill, nxt)
        else:
            # rank 0 records a step after the kill callback: the killed rank's peers may or may not get to it
            assert (lost.last_step or kill.resumed_from) in (kill.step - 1, kill.step), (why, kill, lost)
    assert not (sup.store.root / KILL_MARKER).exists(), (why, "a kill during a checkpoint write never happened")

    final = models[-1].state_dict()
    committed = _load_committed(sup.store, final)
    assert STEPS in committed, (why, sorted(committed))
    written = torch.load(Path(job.run_dir) / FINAL_WEIGHTS, weights_only=True)
    for k, v in final.items():
        assert torch.equal(committed[STEPS][k], v) and torch.equal(written[k], v), (why, k)
        # data parallel on the same global batches: the same weights, whatever the re-plans (world sizes 2-3)
        torch.testing.assert_close(v, reference[k], rtol=1e-4, atol=1e-5, msg=lambda m, k=k: f"{why}: {k}: {m}")

    billing = wiring.billing
    assert billing is not None and billing.ledger_path is not None
    with Ledger.open(Path(billing.ledger_path), create=False, read_only=True, check="full") as ledger:
        checked = check_ledger(ledger)
    assert checked.ok, (why, checked.problems)
    # every attempt leased its ranks (an attempt killed before its first step may not have reached the ledger)
    assert checked.num_leases >= num_ranks + len(attempts) - 1, (why, checked)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("recovery", RECOVERY)
def test_soak_local_launcher(tmp_path, uninterrupted, recovery):
    _soak(tmp_path, "local", recovery, 3, uninterrupted(3))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("recovery", RECOVERY)
def test_soak_ray_launcher(tmp_path, uninterrupted, ray_session, recovery):
    _soak(tmp_path, "ray", recovery, 3, uninterrupted(3))
