"""The plan is checked where it runs: one clear error for each plan the ranks or the model cannot execute, and
the pipeline layout (rank places, uneven chunks) and model cutting it relies on."""

from __future__ import annotations

import pytest
import torch

from starverse.errors import ConfigError
from starverse.plan import Group, Plan, Stage, TrainSpec
from starverse.runtime.launch import RankSpec
from starverse.runtime.modeling import build_model
from starverse.runtime.parallel.pipeline import micro_batch_count_error
from starverse.runtime.parallel.pipeline_layout import PipelineLayout
from starverse.runtime.parallel.pipeline_split import FAMILIES, cut
from starverse.runtime.plan_check import check_model, check_ranks

LLAMA = {
    "model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 64, "max_position_embeddings": 64,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "hidden_act": "silu",
}


def _plan(*stages: Stage, schedule: str = "1f1b", v: int = 1, replicas: int = 1) -> Plan:
    return Plan(model="tiny", groups=[Group(replicas=replicas, stages=list(stages))],
                train=TrainSpec(seq_len=16, global_batch=8, schedule=schedule, virtual_stages=v))  # type: ignore[arg-type]


def _ranks(*kinds: str) -> list[RankSpec]:
    return [RankSpec(r, k) for r, k in enumerate(kinds)]


def test_layers_not_summing_to_the_model():
    plan = _plan(Stage(accelerator="cpu", layers=1), Stage(accelerator="cpu", layers=2))
    with pytest.raises(ConfigError, match=r"groups\[0\]\.stages\[\*\]\.layers sum to 3 but the model has 4 layers"):
        check_model(plan, build_model(LLAMA))


def test_more_stages_than_layers():
    plan = _plan(Stage(accelerator="cpu", layers=1, repeat=5))
    with pytest.raises(ConfigError, match=r"a pipeline of 5 stages but the model has 4 layers"):
        check_model(plan, build_model(LLAMA))


def test_tp_not_dividing_heads():
    plan = _plan(Stage(accelerator="cpu", tp=3, layers=4))
    with pytest.raises(ConfigError, match=r"stages\[0\]\.tp: 3 does not divide the model's 4 attention heads"):
        check_model(plan, build_model(LLAMA))


def test_device_kind_missing_from_the_cluster():
    plan = _plan(Stage(accelerator="cpu", layers=1), Stage(accelerator="tpu-v5e", layers=3))
    with pytest.raises(ConfigError, match=r"the plan uses tpu-v5e but the cluster has no such device"):
        check_ranks(plan, _ranks("cpu", "cpu"))


def test_ranks_in_another_order_than_the_plan():
    plan = _plan(Stage(accelerator="cpu", layers=1), Stage(accelerator="cpu-b", layers=3))
    with pytest.raises(ConfigError, match=r"rank 0 is a cpu-b but the plan puts group 0 stage 0 \(cpu\) there"):
        check_ranks(plan, _ranks("cpu-b", "cpu"))
    check_ranks(plan, _ranks("cpu", "cpu-b"))  # the right order passes


def test_interleaved_stage_with_fewer_layers_than_chunks():
    plan = _plan(Stage(accelerator="cpu", layers=1), Stage(accelerator="cpu", layers=3), schedule="interleaved", v=2)
    with pytest.raises(ConfigError, match=r"stages\[0\]\.layers: 1 cannot be split into train\.virtual_stages=2"):
        check_model(plan, build_model(LLAMA))


def test_a_model_that_cannot_be_cut():
    plan = _plan(Stage(accelerator="cpu", layers=1), Stage(accelerator="cpu", layers=1))
    with pytest.raises(ConfigError, match=r"a pipeline cannot cut Linear .* To fix: pass the model as an nn.Sequential"):
        check_model(plan, torch.nn.Linear(2, 2))


def test_layout_places_and_interleaved_chunks():
    plan = _plan(Stage(accelerator="cpu", layers=2), Stage(accelerator="cpu-b", layers=6), schedule="interleaved",
                 v=2, replicas=2)
    lay = PipelineLayout.from_plan(plan)
    assert [(p.replica, p.stage, p.accelerator) for p in lay.places] == [
        (0, 0, "cpu"), (0, 1, "cpu-b"), (1, 0, "cpu"), (1, 1, "cpu-b")]
    # virtual stages in pipeline order: rank-stage 0 runs chunks 0 and 2, stage 1 runs 1 and 3
    assert [(c.index, c.first_layer, c.num_layers) for c in lay.chunks(0)] == [(0, 0, 1), (1, 1, 3), (2, 4, 1),
                                                                              (3, 5, 3)]
    assert [c.index for c in lay.chunks_of(3)] == [1, 3] and lay.chunks_of(3)[-1].is_last


def test_micro_batch_counts_the_schedules_need():
    assert micro_batch_count_error("1f1b", 4, 3) is not None and micro_batch_count_error("1f1b", 4, 4) is None
    assert micro_batch_count_error("gpipe", 4, 1) is None
    assert micro_batch_count_error("interleaved", 4, 9) is not None and micro_batch_count_error("interleaved", 4, 8) is None


@pytest.mark.parametrize("family", sorted(set(FAMILIES) - {"mixtral", "mpt", "bloom"}))
def test_chunks_chained_equal_the_whole_model_with_unsplit_names(family):
    cfgs = {
        "llama": LLAMA, "mistral": {**LLAMA, "model_type": "mistral"}, "qwen2": {**LLAMA, "model_type": "qwen2"},
        "gpt2": {"model_type": "gpt2", "n_embd": 32, "n_layer": 4, "n_head": 2, "vocab_size": 64, "n_positions": 64,
                 "embd_pdrop": 0.0, "resid_pdrop": 0.0, "attn_pdrop": 0.0},
        "gpt_neox": {"model_type": "gpt_neox", "hidden_size": 32, "num_hidden_layers": 4, "num_attention_heads": 2,
                     "intermediate_size": 64, "vocab_size": 64, "max_position_embeddings": 64},
        "falcon": {"model_type": "falcon", "hidden_size": 32, "num_hidden_layers": 4, "num_attention_heads": 2,
                   "vocab_size": 64, "max_position_embeddings": 64, "new_decoder_architecture": False,
                   "alibi": False},
    }
    model = build_model(cfgs[family])
    model.eval()
    x = torch.randint(0, 64, (2, 12))
    cpu = torch.device("cpu")
    chunks = [cut(model, a, n, a == 0, a + n == 4, cpu, cpu) for a, n in ((0, 1), (1, 2), (3, 1))]
    h = x
    for ch in chunks:
        h = ch.eval()(h)
    torch.testing.assert_close(h, model(x).logits, rtol=0, atol=0)
    names = {n for ch in chunks for n, _ in ch.named_parameters_unsplit()}
    assert names == {n for n, _ in model.named_parameters()}


def test_fit_refuses_the_plan_before_starting_ranks(tmp_path):
    """``Trainer.fit`` checks the cluster's plan first: a wrong split is one error, no rank is started."""
    from starverse.runtime.cluster import Cluster
    from starverse.runtime.trainer import Trainer

    plan = _plan(Stage(accelerator="cpu", layers=3), Stage(accelerator="cpu-b", layers=3))
    cluster = Cluster(plan=plan, ranks=tuple(_ranks("cpu", "cpu-b")))
    with pytest.raises(ConfigError, match=r"the cluster's plan: groups\[0\]\.stages\[\*\]\.layers sum to 6 but the "
                                          r"model has 4 layers\. To fix: make the stages' layers sum to 4\."):
        Trainer(cluster, run_dir=tmp_path).fit(build_model(LLAMA), dataset=["x" * 100], max_steps=1, seq_len=8)
    assert not (tmp_path / "data").exists()


def test_accelerate_checks_what_runs_inside_pipeline_stages():
    """An explicit plan with TP inside pipeline stages passes the cluster's check (it runs now); one whose stages
    have different tp is refused with one line naming the fix."""
    from starverse.runtime.cluster import check_plan_fits_ranks

    tp_pp = _plan(Stage(accelerator="cpu", layers=1, tp=2), Stage(accelerator="cpu", layers=1, tp=2))
    check_plan_fits_ranks(tp_pp, _ranks("cpu", "cpu", "cpu", "cpu"), "plan.yaml")
    mixed = _plan(Stage(accelerator="cpu", layers=1, tp=2), Stage(accelerator="cpu", layers=1, tp=1))
    with pytest.raises(ConfigError, match=r"plan\.yaml: stages have tp \[1, 2\].*To fix: set every stage's tp"):
        check_plan_fits_ranks(mixed, _ranks("cpu", "cpu", "cpu"), "plan.yaml")
