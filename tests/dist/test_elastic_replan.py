"""After a hard loss the supervisor re-plans the survivors with the planner (``plan_for_devices``, same global
batch), and falls back to one group per device kind only when the planner fails.

The planner plans the cluster's model config (a small Llama, as ``accelerate`` gives on CPU ranks); the
module the ranks train is the elastic tests' plain-torch ``TinyLM`` (the runtime trains any module, and the
ranks then need not import transformers: the 3 -> 2 test stays well under 30 s).
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
from test_elastic_recovery import FIT, GLOBAL_BATCH, OPTS, KillAfterCommit, TinyLM, _data

from starverse.checkpoint import CheckpointCallback
from starverse.elastic.preemption import PreemptionCallback
from starverse.elastic.supervisor import Supervisor, replan_with_planner
from starverse.planner import plan_for_devices
from starverse.runtime import Trainer
from starverse.runtime.cluster import Cluster, check_plan_fits_ranks, executable_caps
from starverse.runtime.launch import RankSpec

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

SMALL = {
    "model_type": "llama", "hidden_size": 128, "intermediate_size": 344, "num_hidden_layers": 2,
    "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 8192, "max_position_embeddings": 2048,
}
TRAIN = {"seq_len": 16, "global_batch": GLOBAL_BATCH, "precision": "fp32"}


MID = {**SMALL, "hidden_size": 1024, "intermediate_size": 2752, "num_attention_heads": 8, "num_key_value_heads": 8}
"""Layers large enough that GPUs are not launch-bound (the cost model then tells an A100 from a 4090)."""


def _planned_cluster(kinds: list[str], train: dict, device: str = "cpu", model: dict = SMALL) -> Cluster:
    """A cluster as ``accelerate`` builds it: the planner's plan for these devices, ranks in plan order."""
    counts: dict[str, int] = {}
    for k in kinds:
        counts[k] = counts.get(k, 0) + 1
    best = plan_for_devices(model, counts, train=train, model_name="small-llama").best
    ranks = []
    for g in best.plan.groups:
        ranks.extend(RankSpec(len(ranks), g.stages[0].accelerator, device, 1) for _ in range(g.num_devices))
    check_plan_fits_ranks(best.plan, ranks)
    return Cluster(plan=best.plan, ranks=tuple(ranks), model_config=dict(model), estimate=best.estimate)


@pytest.mark.slow
def test_lost_rank_3_to_2_replanned_by_the_planner_keeps_the_trajectory(tmp_path):
    ref = Trainer(_planned_cluster(["cpu"] * 3, TRAIN), run_dir=tmp_path / "ref", **OPTS).fit(TinyLM(), _data(), **FIT)
    sup = Supervisor(
        _planned_cluster(["cpu"] * 3, TRAIN), tmp_path / "run",
        checkpoint=CheckpointCallback(interval_steps=2), preemption=PreemptionCallback(),
        callbacks=lambda attempt: [KillAfterCommit(rank=2, step=3, committed=2)] if attempt == 1 else [],
        trainer_options=OPTS,
    )
    out = sup.run(lambda c: TinyLM(), _data(), **FIT)
    assert [a.outcome for a in out.attempts] == ["lost", "completed"]
    assert out.attempts[1].device_kinds == ("cpu", "cpu") and out.attempts[1].resumed_from == 2
    # TinyLM cannot be cut into pipeline stages: the re-plan keeps one stage per group; what the runtime executes
    # on CPU ranks of one thread
    caps = executable_caps(sup.cluster.ranks, pipelines=False)
    assert caps.max_pipeline_stages == 1 and caps.offload == "none" and caps.zero_stage is None
    expected = plan_for_devices(SMALL, {"cpu": 2}, train={**TRAIN, "mode": "full", "lora_rank": 16},
                                model_name="small-llama", runtime_caps=caps, cpu_threads=1).best
    assert all(g.num_stages == 1 for g in sup.cluster.plan.groups)
    assert sup.cluster.plan == expected.plan and sup.cluster.plan.train.global_batch == GLOBAL_BATCH
    assert sup.cluster.estimate.step_time_s == pytest.approx(expected.estimate.step_time_s)
    assert sup.cluster.notes[-1] == (
        f"re-planned after losing cpu (rank 2): 2 ranks, planned by the planner (objective throughput): "
        f"{expected.layout()}; estimate: step {expected.estimate.step_time_s:.4g} s, {expected.tokens_per_s:,.0f} "
        f"tokens/s, global batch {GLOBAL_BATCH}")
    # same global batch on 2 ranks: the loss trajectory continues
    np.testing.assert_allclose(out.fit.losses, ref.losses[2:], rtol=1e-4)


def test_replan_falls_back_per_kind_when_the_batch_does_not_split(caplog):
    cluster = _planned_cluster(["cpu"] * 4, {"seq_len": 16, "global_batch": 16, "precision": "fp32"})
    with caplog.at_level(logging.WARNING, logger="starverse.elastic.supervisor"):
        new = replan_with_planner(cluster, cluster.ranks[:3], cluster.ranks[3:])
    assert [(g.replicas, g.stages[0].accelerator) for g in new.plan.groups] == [(3, "cpu")]
    assert new.plan.train.global_batch == 16 and [r.rank for r in new.ranks] == [0, 1, 2]
    note = new.notes[-1]
    assert note.startswith("re-planned after losing cpu (rank 3): 3 ranks, one data-parallel group per device "
                           "kind (planner not used: InfeasiblePlanError: no plan for small-llama on <devices>: "
                           "every device must be used (3×cpu")
    assert note.endswith("a global batch of 15 or 18, or use fewer devices (searched only what the runtime executes: "
                         "offload none, full training, every device used)), global batch 16")
    assert any(r.message.startswith("planner not used for the re-plan (InfeasiblePlanError: ")
               for r in caplog.records)


def test_replan_of_mixed_kinds_splits_the_batch_by_speed_and_orders_ranks_like_the_plan():
    # 16 micro-batches of 8: enough for the split to show the A100 ~1.2x the 4090 here (8 round to 4 / 4)
    train = {"seq_len": 512, "global_batch": 128, "precision": "bf16"}
    cluster = _planned_cluster(["rtx-4090", "rtx-4090", "a100-80gb-sxm"], train, device="cuda:0", model=MID)
    lost = next(r for r in cluster.ranks if r.device_kind == "rtx-4090")
    survivors = [r for r in cluster.ranks if r is not lost]
    new = replan_with_planner(cluster, survivors, [lost])
    expected = plan_for_devices(MID, {"rtx-4090": 1, "a100-80gb-sxm": 1}, train={**train, "mode": "full"},
                                model_name="small-llama", runtime_caps=executable_caps(survivors)).best
    assert new.plan == expected.plan and expected.kind == "hetero-dp"
    check_plan_fits_ranks(new.plan, new.ranks)
    assert [r.device_kind for r in new.ranks] == [g.stages[0].accelerator for g in new.plan.groups]
    shares = dict(zip([r.device_kind for r in new.ranks], new.rank_weights(), strict=True))
    assert shares["a100-80gb-sxm"] > shares["rtx-4090"]  # the faster device takes more of the same batch
    assert sum(g.batch_share for g in new.plan.groups) == pytest.approx(1.0)
    assert new.plan.train.global_batch == 128
