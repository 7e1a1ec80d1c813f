"""The leave-one-source-out script: every fitted constant refitted without each source (issue 9, item 3)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from starverse.costmodel import constants as C
from starverse.costmodel.fit import FITTED, SCORED_NOT_FITTED

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def loso(loso_document: dict) -> dict:
    """The script's output (tests/unit/conftest.py runs ``scripts/loso.py`` once per session)."""
    return loso_document


def test_every_fitted_constant_is_refitted_without_each_source(loso: dict) -> None:
    sources = {"korthikanti2022", "megatron", "megatron2021", "mpt", "sailor", "amp_t4", "amp_mixed", "sailor_gh200",
               "nemo2412", "nemolong", "fmsfsdp", "mptscale", "mptlong", "opt", "bigscience", "dtfm", "dtfmslow",
               "dlperf", "tr3m", "maxtext_v5e", "maxtext_v5p"}
    assert set(loso["fitted"]) == {c.name for c in FITTED} == {
        "SUSTAINED_FRACTION", "TPU_MATMUL_FRACTION", "PRE_AMPERE_EFFICIENCY", "PCIE_COLLECTIVE_FRACTION",
        "HOST_OVERHEAD_PER_LAYER_S"}
    for const in FITTED:
        fit = loso["fitted"][const.name]
        # the committed value is the fit on all sources (rounded), not a hand-picked one
        assert fit["all"] == pytest.approx(getattr(C, const.name), rel=0.01)
        assert set(fit["without"]) == sources
        assert all(const.lower <= v <= const.upper for v in fit["without"].values())
    # the scored-but-not-fitted sources (DT-FM's, DLPerf's and tr3m's V100 runs) move no fit: without them is the fit on all
    for src in SCORED_NOT_FITTED:
        assert all(loso["fitted"][c.name]["without"][src] == loso["fitted"][c.name]["all"] for c in FITTED), src
    # the sustained matmul fraction is not specific to one software stack
    sustained = loso["fitted"]["SUSTAINED_FRACTION"]
    assert all(abs(v - sustained["all"]) < 0.03 for v in sustained["without"].values()), sustained
    # the PCIe collective fraction is identified by the PCIe nodes without a measured collective figure: AMP's T4
    # nodes (AWS G instances, no PCIe peer-to-peer). Sailor's GeForce nodes state what NCCL reached on them per
    # group size (network.collective_gb_per_s: the RTX 3090 node's NVLink-bridged pair 35.8 GB/s, 8 GPUs 1.65),
    # which one fraction could not express (it was 0.53 without AMP's T4 runs, 0.77 without Sailor's)
    pcie = loso["fitted"]["PCIE_COLLECTIVE_FRACTION"]
    assert abs(pcie["without"]["sailor"] - pcie["all"]) < 0.01, pcie
    assert pcie["without"]["amp_t4"] < pcie["all"] - 0.1, pcie
    assert all(0.5 <= v <= 0.86 for v in pcie["without"].values()), pcie
    # one host launch time serves AMP's 2020 V100/T4 hosts and the GH200 runs once AMP's second forward is
    # counted (3.75-5.16 ms held out before, 5.16 ms from AMP alone)
    host = loso["fitted"]["HOST_OVERHEAD_PER_LAYER_S"]
    assert max(host["without"].values()) <= 1.25 * min(host["without"].values()), host


def test_held_out_figures_against_the_targets(loso: dict) -> None:
    held = loso["held_out"]
    # the A100/H100 sources meet the rank target held out; medians within 12 %, p90 within 29 % (megatron2021's
    # pre-FlashAttention 1.7B/3.6B runs: 26 % before the NeMo/fms-fsdp sources raised the fit)
    for src in ("korthikanti2022", "megatron", "megatron2021", "mpt", "fmsfsdp", "nemo2412", "nemolong"):
        assert held[src]["p90_abs_error"] <= 0.29, src
        assert held[src]["median_abs_error"] <= 0.12, src
        assert held[src]["meets"]["spearman"] in (True, None), src
    # fms-fsdp: its four cases are the batch-2 rows of one README table (A100 and H100, 34B and 70B; 13.4 % held
    # out while its 70B case was an earlier table's batch-6 row): met; its A100 runs are 8-15 % too slow (13-19 %
    # while full recompute ran the down projection again, which PyTorch's early stop skips: open miss,
    # docs/costmodel.md `fmsfsdp`)
    fms = held["fmsfsdp"]
    assert fms["n"] == 4 and all(ok in (True, None) for ok in fms["meets"].values()), fms
    assert 0.10 <= fms["max_abs_error"] <= 0.16 and fms["p90_abs_error"] <= 0.14, fms
    # NeMo's FP8 runs meet the targets held out since FP8 GEMMs' shape term is per operand byte (13.7 % before)
    # and its LLAMA2-7B 4K-1M runs (six with context parallelism) since the H100's attention runs at cuDNN's
    # measured rate (13.2 % before; the CP runs were 11-24 % too fast)
    assert all(ok in (True, None) for ok in held["nemo2412"]["meets"].values()), held["nemo2412"]
    nemolong = held["nemolong"]
    assert nemolong["n"] == 9 and nemolong["meets"]["spearman"] is True
    assert nemolong["median_abs_error"] <= 0.08 and nemolong["meets"]["p90_abs_error"] is True
    # llm-foundry on 8 H100s at 8K-64K tokens (issue 9's "7B at 64K on 8 H100s", +82 % before): ranked in order,
    # still too fast (MPT's Triton FlashAttention with ALiBi: open miss, docs/costmodel.md)
    long = held["mptlong"]
    assert long["n"] == 14 and long["spearman"] >= 0.95
    assert long["median_abs_error"] <= 0.21 and long["meets"]["median_abs_error"] is False
    # the mixed consumer cluster: ranked in order since the OPT model is read as Sailor's OPTModelPipe builds it
    # (no dropout, ReLU, untied head); every run that ran fits (item 4; sailor-mit-n2-d2 was refused while
    # dropout masks were charged); peak memory misses (open). Since the cases state what Sailor's own runtime
    # reached on its nodes (the RTX 3090's 8 GPUs 1.65 GB/s busbw, 1.35 in Aceso's microbenchmark) and that their
    # inter-node figures are NCCL's achieved rates (network.achieved_gbps) the median and p90 targets are met:
    # 7.2 % / 17.7 % (15.3 % / 29.7 % before; the 2-stage RTX 3090-first pipelines with DP, n4-d2 / n6-d3, are
    # still 17-19 % too slow: open miss, docs/costmodel.md)
    sailor = held["sailor"]
    assert sailor["meets"]["spearman"] is True
    assert sailor["median_abs_error"] <= 0.09 and sailor["p90_abs_error"] <= 0.20
    assert sailor["meets"]["median_abs_error"] is True and sailor["meets"]["p90_abs_error"] is True
    assert sailor["failed_cases"] == [] and sailor["meets"]["fits_as_reported"] is True
    # peak memory (no fitted constant touches it): the two N2 logs are excluded with their evidence
    # (measured.peak_memory_excluded); the TP 8 pipelines are within 10 %, the pure data-parallel TP 8 runs 22 %
    # under (open miss, docs/costmodel.md)
    assert sailor["memory_n"] == 7 and sailor["meets"]["peak_memory"] is False
    assert sailor["memory_median_abs_error"] <= 0.10 and sailor["memory_max_abs_error"] <= 0.25
    # GH200: every compared log within 10 % since DeepSpeed's flat gradient copy is counted (52 % with dropout
    # masks charged, 24 % before the copy and with GPT-Neo n8-pp4-dp2's contradicted log compared)
    gh_mem = held["sailor_gh200"]
    assert gh_mem["memory_n"] == 25 and gh_mem["meets"]["peak_memory"] is True
    assert gh_mem["memory_max_abs_error"] <= 0.07
    # BigScience's first-node nvidia-smi readings: within 10 % since the bf16 cast of BF16_Optimizer's fp32
    # gradients in DeepSpeed's flat all-reduce is counted (11-17 % under before); of the three runs that failed
    # for memory, d_model 14336 / 82 layers is still estimated to fit (open miss, docs/costmodel.md)
    big = held["bigscience"]
    assert big["memory_n"] == 17 and big["meets"]["peak_memory"] is True and big["memory_max_abs_error"] <= 0.07
    assert big["failed_cases"] == ["bigscience-h14336-l82-a128-dp8-tp4-pp12-mbs2"]
    # AMP's clusters held out (before the host-overhead, PCIe and gradient-reduce terms: medians 24 % / 17 %,
    # Spearman 0.56 / 0.35): 16 x T4 meets every target since Sailor's GH200 runs also identify the host's
    # launch time (4.5 % / 16 % / 0.97; 13.0 % / 27.5 % / 0.86 before), V100 + T4 the median (7.7 %); its p90
    # and rank are open misses (docs/costmodel.md)
    assert all(ok in (True, None) for ok in held["amp_t4"]["meets"].values()), held["amp_t4"]
    assert held["amp_mixed"]["meets"]["median_abs_error"] is True
    # Sailor's GH200 runs held out: ranked in order (the TF32 reading and the launch floor), and the median met
    # since fp32 eager attention pays the unfused softmax's passes (19.6 % before)
    assert held["sailor_gh200"]["spearman"] >= 0.95
    # and its micro-batch-1/2 OPT rows no longer pay AMP's second forward in the host constant: p90 34.6 % before
    # (the GPT-Neo micro-batch-1 rows, whose code prints its input tensors every micro-batch, and OPT at
    # micro-batch 2-4 with pipeline 1 remain: open, docs/costmodel.md)
    assert held["sailor_gh200"]["p90_abs_error"] <= 0.25
    assert held["sailor_gh200"]["meets"]["median_abs_error"] is True
    assert held["sailor_gh200"]["meets"]["median_abs_error"] is True
    for src in ("amp_t4", "amp_mixed"):
        assert held[src]["median_abs_error"] <= 0.14, src
        assert held[src]["spearman"] >= 0.7, src
    # llm-foundry's FSDP runs on 64-512 GPUs held out: ranked in order, every target met since full recompute
    # stops at the down projection as PyTorch 2.1's non-reentrant checkpoint does (train.recompute_early_stop;
    # median 7.8 % before, 12.5 % before NCCL's ring latency; the model keeps tokens/s per GPU flat from 128 to
    # 512 GPUs where measured falls 2.5-10 %: docs/costmodel.md, `mptscale`)
    scale = held["mptscale"]
    assert scale["n"] == 21 and scale["spearman"] >= 0.95
    assert all(ok in (True, None) for ok in scale["meets"].values()) and scale["median_abs_error"] <= 0.06
    # OPT-175B (FSDP ZeRO-3 over 124 replicas x TP 8, 992 A100s) held out: within the median target
    assert held["opt"]["n"] == 1 and held["opt"]["meets"]["median_abs_error"] is True
    # BigScience's 176B layout search held out: ranked (0.70 before its rows stated the fork's fused-softmax
    # check: NHEADS 104 on TP 4 and TP 8 at micro-batch 2 took the torch softmax), median and p90 met
    bs = held["bigscience"]
    assert bs["n"] == 19 and bs["meets"]["spearman"] is True and bs["spearman"] >= 0.85
    assert bs["meets"]["median_abs_error"] is True and bs["p90_abs_error"] <= 0.10
    # DLPerf's Megatron-LM runs on 1-4 nodes of 8 V100-16GB (scored, not fitted: costmodel.fit.SCORED_NOT_FITTED),
    # held out by construction: ranked in order, the median met since eager attention's softmax counts what its
    # kernels move and the V100 runs at its measured matmul fraction (20.7 % before), p90 missed (too fast where a
    # TP group spans nodes and at TP 8 x PP 4: open, docs/costmodel.md `dlperf`), nvidia-smi memory median within 10 %
    dl = held["dlperf"]
    assert dl["n"] == 16 and dl["meets"]["spearman"] is True and dl["meets"]["fits_as_reported"] is True
    assert dl["meets"]["median_abs_error"] is True and dl["meets"]["p90_abs_error"] is False
    # (TP 32's log, below the tensors its ranks hold, is kept but not compared: measured.peak_memory_excluded)
    assert dl["memory_n"] == 15 and dl["memory_median_abs_error"] <= 0.10
    # BigScience's tr3m-1B3 layouts on 2 nodes of 4 V100 (scored, not fitted), held out by construction: ranked,
    # median missed, p90 met since the V100's measured matmul fraction (every TP 1 run 9-22 % too slow, 28-37 % before:
    # open, docs/costmodel.md `tr3m`), memory missed, and
    # all 4 out-of-memory rows estimated to fit
    tr = held["tr3m"]
    assert tr["n"] == 23 and tr["meets"]["spearman"] is True and tr["spearman"] >= 0.8
    assert tr["meets"]["median_abs_error"] is False and tr["meets"]["fits_as_reported"] is False
    assert tr["meets"]["p90_abs_error"] is True
    assert tr["memory_n"] == 23 and tr["memory_median_abs_error"] <= 0.15
    # MaxText's TPU runs: the TPU matmul fraction held out is fitted on the other generation (v5p alone: 0.730,
    # v5e alone: 0.747 since the slices' shards are all-reduced over the data-centre network; 0.724 / 0.742 before,
    # since full recompute on a TPU runs again only what the backward reads; 0.756 / 0.829
    # before, 0.840 / 0.897 before the cases read MaxText's batch and minimal recompute as it runs them); both meet
    # every target held out (docs/costmodel.md `maxtext`); every run fits, as it ran
    tpu = loso["fitted"]["TPU_MATMUL_FRACTION"]["without"]
    assert 0.70 <= tpu["maxtext_v5e"] < tpu["maxtext_v5p"] <= 0.78 and tpu["maxtext_v5p"] - tpu["maxtext_v5e"] < 0.03
    v5e, v5p = held["maxtext_v5e"], held["maxtext_v5p"]
    assert v5e["n"] == 24 and all(ok in (True, None) for ok in v5e["meets"].values()) and v5e["spearman"] >= 0.95
    assert v5p["n"] == 16 and all(ok in (True, None) for ok in v5p["meets"].values()) and v5p["spearman"] >= 0.95
    assert loso["pooled"]["n"] == 383  # 235 + DT-FM's 69 + DLPerf's 16 + tr3m's 23 + MaxText's 24 + 16


def test_forked_held_out_fits_give_the_serial_figures(monkeypatch: pytest.MonkeyPatch) -> None:
    """The held-out fits run on one forked worker per CPU; the figures are those of one process."""
    import os

    from starverse.catalog import load_catalog
    from starverse.costmodel import fit
    from starverse.costmodel.validate import find_cases, load_case

    folder = REPO / "data" / "validation"
    files = [p for p in find_cases([str(folder)]) if Path(p).name.startswith(("megatron-core", "fmsfsdp", "nemo"))]
    cases = [load_case(p) for p in files][:12]
    assert len({c.source for c in cases}) >= 2
    catalog = load_catalog()
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1}, raising=False)
    forked = fit.leave_one_source_out(cases, catalog)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0}, raising=False)
    serial = fit.leave_one_source_out(cases, catalog)
    assert json.dumps(forked, sort_keys=True, default=str) == json.dumps(serial, sort_keys=True, default=str)
