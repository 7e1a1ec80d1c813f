"""Measured model profiles (issue 9, item 2): how the estimator uses them, and one clear error per bad input."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from helpers import CLI, TINY
from starverse.catalog import load_catalog
from starverse.costmodel import ModelShape, estimate
from starverse.costmodel.profile import PROFILE_FORMAT, load_profile, shape_key
from starverse.errors import ConfigError
from starverse.models import load_model
from starverse.plan import load_plan

CAT = load_catalog()
LAYER_F, LAYER_B, HEAD_F, HEAD_B, OPT = 0.010, 0.020, 0.004, 0.006, 1e-8


def write_case(tmp: Path, profile: dict | str | None = None, *, layers: int = 4, mb: int = 2, m: int = 3,
               recompute: str = "none", early_stop: bool = True) -> Path:
    cfg = TINY | {"num_hidden_layers": layers}
    (tmp / "tiny.json").write_text(json.dumps(cfg))
    if profile is not None:
        (tmp / "prof.json").write_text(profile if isinstance(profile, str) else json.dumps(profile))
    net = "network: {profiles: {cpu: prof.json}}\n" if profile is not None else ""
    plan = tmp / "plan.yaml"
    plan.write_text(f"model: tiny.json\ntrain: {{seq_len: 64, global_batch: {mb * m}, precision: fp32, "
                    f"recompute: {recompute}, recompute_early_stop: {str(early_stop).lower()}}}\n"
                    f"groups:\n- micro_batch: {mb}\n  stages: [{{accelerator: cpu, layers: {layers}}}]\n{net}")
    return plan


def profile_doc(tmp: Path, **changes: object) -> dict:
    spec = load_model(TINY)
    doc = {"format": PROFILE_FORMAT, "version": 1, "accelerator": "cpu",
           "model": shape_key(ModelShape.from_spec(spec)),
           "entries": [{"micro_batch": 2, "seq_len": 64, "tp": 1, "precision": "fp32", "layer_forward_s": LAYER_F,
                        "layer_backward_s": LAYER_B, "head_forward_s": HEAD_F, "head_backward_s": HEAD_B}],
           "links_gb_per_s": {}, "optimizer_s_per_param": OPT}
    return doc | changes


def test_measured_layer_times_replace_the_analytic_compute(tmp_path: Path) -> None:
    est = estimate(load_plan(write_case(tmp_path, profile_doc(tmp_path))), CAT)
    compute = est.breakdown["compute"] + est.breakdown["memory"]
    params = load_model(TINY | {"num_hidden_layers": 4}).num_params
    # 3 micro-batches x (4 layers x fwd+bwd + head fwd+bwd) + the measured optimizer step
    assert compute == pytest.approx(3 * (4 * (LAYER_F + LAYER_B) + HEAD_F + HEAD_B) + params * OPT, rel=1e-5)
    # full recompute runs each layer's forward once more (Megatron's checkpoint) ...
    whole = estimate(load_plan(write_case(tmp_path, profile_doc(tmp_path), recompute="full", early_stop=False)), CAT)
    assert whole.breakdown["compute"] - est.breakdown["compute"] == pytest.approx(3 * 4 * LAYER_F, rel=1e-9)
    # ... or all of it but the down projection (PyTorch's early stop): its analytic share of the measured forward
    full = estimate(load_plan(write_case(tmp_path, profile_doc(tmp_path), recompute="full")), CAT)
    again = (full.breakdown["compute"] - est.breakdown["compute"]) / (3 * 4 * LAYER_F)
    assert 0.5 < again < 0.95, again


def test_settings_not_in_the_profile_use_the_analytic_model(tmp_path: Path) -> None:
    analytic = estimate(load_plan(write_case(tmp_path, None, mb=3)), CAT)
    with_profile = estimate(load_plan(write_case(tmp_path, profile_doc(tmp_path), mb=3)), CAT)
    assert with_profile.breakdown["compute"] == pytest.approx(analytic.breakdown["compute"], rel=1e-12)


@pytest.mark.parametrize(("changes", "message"), [
    ({"accelerator": "rtx-4090"}, "was measured on 'rtx-4090', not 'cpu'"),
    ({"model": {**shape_key(ModelShape.from_spec(load_model(TINY))), "hidden_size": 64}},
     "is of another model (hidden_size=64; the plan's model has hidden_size=32)"),
    ({"version": 2}, "version: 2 is newer than this starverse reads (1)"),
    ({"links_gb_per_s": {"intra_node": 0}}, "links_gb_per_s.intra_node: must be a number > 0 (got 0)"),
    ({"links_gb_per_s": {"intra_node": -3.0}}, "links_gb_per_s.intra_node: must be a number > 0"),
    ({"format": "something-else"}, "not a starverse model profile"),
])
def test_bad_profiles_are_one_clear_error(tmp_path: Path, changes: dict, message: str) -> None:
    plan = load_plan(write_case(tmp_path, profile_doc(tmp_path, **changes)))
    with pytest.raises(ConfigError, match="network.profiles.cpu: .*" + message.replace("(", r"\(")
                       .replace(")", r"\)").replace(".", r"\.").replace("'", "'")):
        estimate(plan, CAT)


def test_corrupt_profile_is_one_line_and_exit_2(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"corrupt profile \(not JSON"):
        load_profile(write_case(tmp_path, '{"format": "starverse-model-pro') .parent / "prof.json")
    res = subprocess.run([*CLI, "estimate", str(tmp_path / "plan.yaml")], capture_output=True, text=True,
                         check=False)
    assert res.returncode == 2
    assert "network.profiles.cpu:" in res.stderr and "corrupt profile" in res.stderr
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_probe_writes_a_profile_the_estimator_uses(tmp_path: Path) -> None:
    plan = write_case(tmp_path, None)
    out = tmp_path / "cpu-prof.json"
    res = subprocess.run([*CLI, "probe", "--plan", str(plan), "--ranks", "1", "--quick", "--out", str(out)],
                         capture_output=True, text=True, check=False, timeout=300)
    assert res.returncode == 0, res.stderr
    prof = load_profile(out)
    assert prof.accelerator == "cpu" and prof.model == shape_key(ModelShape.from_spec(load_model(TINY)))
    (e,) = prof.entries
    assert (e.micro_batch, e.seq_len, e.tp, e.precision) == (2, 64, 1, "fp32")
    assert prof.optimizer_s_per_param is not None and prof.optimizer_s_per_param > 0
    plan.write_text(plan.read_text() + "network: {profiles: {cpu: cpu-prof.json}}\n")
    est = estimate(load_plan(plan), CAT)
    # the estimate's compute is the measured layers and head, nothing analytic
    assert est.breakdown["compute"] == pytest.approx(
        3 * (4 * (e.layer_forward_s + e.layer_backward_s) + e.head_forward_s + e.head_backward_s), rel=1e-9)


def test_probe_model_errors(tmp_path: Path) -> None:
    from starverse.runtime.probe import probe_model

    plan = write_case(tmp_path, None)
    res = subprocess.run([*CLI, "probe", "--model", str(tmp_path / "tiny.json")], capture_output=True, text=True,
                         check=False)
    assert res.returncode == 2 and "also pass --plan" in res.stderr
    with pytest.raises(ConfigError, match="the plan has no stage on 'rtx-4090'"):
        probe_model(load_plan(plan), load_model(TINY), "rtx-4090")
    gpt2 = {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 2, "vocab_size": 64, "n_positions": 64}
    plan.write_text(plan.read_text().replace("accelerator: cpu", "accelerator: cpu, tp: 2"))
    with pytest.raises(ConfigError, match="tp=2 needs a model family whose layers can be built as one TP shard"):
        probe_model(load_plan(plan), load_model(gpt2), "cpu")
    # a precision the probe cannot measure (tf32, fp8): one line naming the field
    tf32 = load_plan(plan).model_copy(update={"train": load_plan(plan).train.model_copy(update={"precision": "tf32"})})
    with pytest.raises(ConfigError, match=r"probe: train\.precision 'tf32' is not measured; probe with one of fp32"):
        probe_model(tf32, load_model(TINY), "cpu")


def test_batch_path_uses_a_profile_as_the_scalar_estimate_does(tmp_path: Path) -> None:
    """The planner's batch search (estimate_batch) applies an offer's profile exactly as ``estimate`` applies
    ``network.profiles``: measured layers, head, optimizer step and intra-node link; other micro-batches stay
    analytic."""
    from starverse.costmodel import Candidates, DeviceTable, TrainShape, estimate_batch

    doc = profile_doc(tmp_path, links_gb_per_s={"intra_node": 3.0})
    plan = load_plan(write_case(tmp_path, doc, layers=4, mb=2, m=3))
    est = estimate(plan, CAT)
    prof = load_profile(tmp_path / "prof.json")
    spec = load_model(TINY | {"num_hidden_layers": 4})
    shape, train = ModelShape.from_spec(spec), TrainShape.from_train(plan.train)
    cand = Candidates.make(accelerator=0, tp=1, pp=1, replicas=1, micro_batch=[2, 3], num_micro_batches=[3, 2])
    measured = estimate_batch(shape, train, DeviceTable.from_accelerators([CAT.accelerator("cpu")], "fp32",
                                                                         profiles=[prof]), cand)
    analytic = estimate_batch(shape, train, DeviceTable.from_accelerators([CAT.accelerator("cpu")], "fp32"), cand)
    assert measured.step_time_s[0] == pytest.approx(est.step_time_s, rel=1e-9)
    assert measured.step_time_s[0] != pytest.approx(analytic.step_time_s[0], rel=1e-3)
    # micro-batch 3 has no entry: analytic layers (the profile's optimizer and link figures still apply),
    # again as in the scalar estimate
    est3 = estimate(load_plan(write_case(tmp_path, doc, layers=4, mb=3, m=2)), CAT)
    assert measured.step_time_s[1] == pytest.approx(est3.step_time_s, rel=1e-9)


def test_probe_times_with_the_clock_it_is_given() -> None:
    """A check on a shared CPU times the profile and the steps with one clock (``bench_estimate``: process CPU
    time); the probe uses the clock it is passed for every measurement."""
    import torch

    from starverse.runtime.modeling import hf_config_dict
    from starverse.runtime.probe import optimizer_s_per_param, profile_entry

    ticks = iter(range(10**6))

    def clock() -> float:  # one second per reading: every measured interval is exactly 1 s
        return float(next(ticks))

    e = profile_entry(hf_config_dict(load_model(TINY)), 1, 16, 1, "fp32", torch.device("cpu"), repeats=2, clock=clock)
    assert (e["layer_forward_s"], e["layer_backward_s"]) == (1e-6, 1e-6)  # depth 3 takes as long as depth 1
    assert e["head_forward_s"] == pytest.approx(1.0, abs=1e-5) and e["head_backward_s"] == pytest.approx(1.0, abs=1e-5)
    assert optimizer_s_per_param(torch.device("cpu"), num_params=4096, repeats=2, clock=clock) == pytest.approx(1 / 4096)
