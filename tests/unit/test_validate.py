"""The cost model against the published runs in data/validation (targets of issue 2)."""

from __future__ import annotations

from pathlib import Path

import pytest
from scipy.stats import spearmanr

from starverse.catalog import load_catalog
from starverse.config import read_yaml
from starverse.costmodel.validate import (
    MIN_CONFIGS_FOR_SPEARMAN,
    CaseResult,
    by_source,
    find_cases,
    run_case,
    spearman,
    summarize,
)

CASES = Path(__file__).resolve().parents[2] / "data" / "validation"
CAT = load_catalog()


@pytest.fixture(scope="module")
def results() -> list[CaseResult]:
    return [run_case(p, CAT) for p in find_cases([CASES])]


KNOWN_REFUSED: set[str] = set()
"""Runs that ran but that the estimator says do not fit (open misses, data/validation/README.md): none. DT-FM's
two 39B runs at micro-batch 4 on V100-16GB were (16.5 of 15.9 GB with Adam's states) until their cases stated the
SGD they ran (``optimizer: sgd``: 13.9 GB); Sailor's since its OPT is read as its ``OPTModelPipe`` builds it
(``sailor-mit-n2-d2`` was refused before)."""
KNOWN_OOM_FITS = {"bigscience-h14336-l82-a128-dp8-tp4-pp12-mbs2", "tr3m-32gb-tp1-pp2-dp4-mbs16"}
"""Runs the source reports as failed for memory that the estimator says fit (open misses of issue 9, item 4: one
layout of BigScience's 176B search, one transformer layer per stage more than a run that read 60 GiB;
docs/costmodel.md, ``bigscience``; tr3m-1B3's PP 2 / micro-batch 16 on 32 GB, 31.7 of 32.0 GB: docs/costmodel.md,
``tr3m``). DP 16 / PP 6 at micro-batch 1 is refused since the bf16 cast of BF16_Optimizer's fp32 gradients is
counted; tr3m's three micro-batch 8 rows on 16 GB (PP 2 / 4 / 8) since its last stage's pipe buffers keep fp32
logits (``pipe_buffers_keep_outputs: fp32``: 17.9-19.3 of 15.9 GB; 14.1-15.5 before)."""
PUBLISHED_A100_H100 = ("korthikanti2022", "megatron", "megatron2021", "mpt")


def test_every_published_case_is_estimated_and_only_the_known_misses_are_refused(results: list[CaseResult]) -> None:
    assert len(results) == len([p for p in CASES.rglob("*.yaml") if "models" not in p.parts]) == 390
    assert all(r.predicted is not None and (r.measured is not None or r.out_of_memory) for r in results)
    failed = {r.name for r in results if not r.ok}
    assert failed == KNOWN_REFUSED | KNOWN_OOM_FITS
    assert all("does not fit" in (r.reason or "") for r in results if not r.ok and r.name in KNOWN_REFUSED)
    assert all("failed for memory, but the estimator says it fits" in (r.reason or "")
               for r in results if r.name in KNOWN_OOM_FITS)


def test_rank_correlation_target(results: list[CaseResult]) -> None:
    assert summarize(results)["spearman"] >= 0.8
    # issue 9: Spearman >= 0.8 within every source of >= 8 configurations, in sample (held out:
    # tests/unit/test_loso.py). AMP's two clusters were 0.56 / 0.35 before the host-overhead, PCIe and
    # gradient-reduce terms; 16 x T4 meets it now (0.97), V100 + T4 does not (0.74: open miss)
    by = by_source(results)
    meets = {src for src, s in by.items() if s["n"] >= MIN_CONFIGS_FOR_SPEARMAN and s["spearman"] >= 0.8}
    # nemolong: NeMo's LLAMA2-7B 4K-1M runs, 6 of them with context parallelism (groups[].cp)
    # mptlong: llm-foundry's 8-H100 runs at 8K-64K tokens (14 configurations)
    # bigscience (19): met (0.89) since its 02-28 rows state the fork's fused-softmax check (softmax_fusion:
    # megatron-bsc-2022): NHEADS 104 on TP 4 and TP 8 at micro-batch 2 took the torch softmax (0.70 before)
    # dtfmslow: DT-FM's Megatron baselines on 64 single-V100 instances (12 configurations); dtfm (57 on 8 x 8
    # V100s) misses it: its micro-batch-2 rows with TP > 1 ran 1.3-2.7x slower than micro-batch 1 and 4 (open)
    # dlperf: DLPerf's Megatron-LM runs on 1-4 nodes of 8 V100-16GB (16 configurations), ranked although too slow
    # tr3m: BigScience's tr3m-1B3 layouts on 2 nodes of 4 V100 (23 that ran), ranked although too slow
    # maxtext_v5e, maxtext_v5p: MaxText's TPU runs (24: 4 shapes x 1-32 v5e slices; 16: 6 shapes on 1-2 v5p slices)
    assert meets == {"korthikanti2022", "megatron2021", "mpt", "sailor", "amp_t4", "sailor_gh200", "nemolong",
                     "mptscale", "mptlong", "bigscience", "dtfmslow", "dlperf", "tr3m", "maxtext_v5e", "maxtext_v5p"}
    assert by["bigscience"]["spearman"] >= 0.85
    assert by["amp_mixed"]["spearman"] >= 0.7


def test_error_targets_on_the_published_a100_h100_runs(results: list[CaseResult]) -> None:
    # issue 2's targets on its 37 runs: median <= 10 %, p90 <= 20 %, max <= 30 % (measured at this commit:
    # 6.6 %, 15.6 %, 26.6 %, all met since the Megatron-Core cases state their TP overlap; the max is megatron2021's
    # pre-FlashAttention 1.7B run; 8.3 %, 20.1 %, 35.4 % with SUSTAINED_FRACTION at 0.795, before the llm-foundry
    # at-scale rows)
    s = summarize([r for r in results if r.source in PUBLISHED_A100_H100])
    assert s["n"] == 37
    assert s["median_abs_error"] <= 0.10
    assert s["p90_abs_error"] <= 0.20
    assert s["max_abs_error"] <= 0.30


def test_per_source_figures_and_peak_memory(results: list[CaseResult]) -> None:
    sources = by_source(results)
    assert set(sources) == {*PUBLISHED_A100_H100, "sailor", "amp_t4", "amp_mixed", "sailor_gh200", "nemo2412",
                            "nemolong", "fmsfsdp", "mptscale", "mptlong", "opt", "bigscience", "dtfm", "dtfmslow",
                            "dlperf", "tr3m", "maxtext_v5e", "maxtext_v5p"}
    # DT-FM's Megatron-LM baselines on 64 V100s at AWS: 8 x p3.16xlarge (57 runs) and 64 x p3.2xlarge (12); open
    # misses by layout (docs/costmodel.md `dtfm`): PP 4 x TP 2 at micro-batch 1 within 6 % (12-17 % too slow while the
    # V100 ran at the T4-fitted matmul fraction and the eager softmax's bytes were counted twice), pipelines across
    # instances at micro-batch 1 too fast (a cost of 40-100 ms per micro-batch the model lacks), within 27 % at
    # micro-batch 4
    assert (sources["dtfm"]["n"], sources["dtfmslow"]["n"]) == (57, 12)
    by_name = {r.name: r for r in results}
    for layers in (24, 32, 40):
        for gbs in (1024, 2048, 4096):
            assert abs(by_name[f"dtfm-l{layers}-b{gbs}-p4-t2-d8-mb1"].error or 1.0) <= 0.06, (layers, gbs)
            assert (by_name[f"dtfm-l{layers}-b{gbs}-p8-t1-d8-mb1"].error or 0.0) >= 0.15, (layers, gbs)
        assert (by_name[f"dtfmslow-l{layers}-b1024-p8-t1-d8-mb1"].error or 0.0) >= 0.5, layers
        assert abs(by_name[f"dtfm-l{layers}-b1024-p8-t1-d8-mb4"].error or 1.0) <= 0.27, layers
        # TP groups across the 9.59 Gbit/s single-GPU instances: within 16 %
        for pp, tp in ((1, 8), (4, 2)):
            assert abs(by_name[f"dtfmslow-l{layers}-b1024-p{pp}-t{tp}-d8-mb1"].error or 1.0) <= 0.16, (layers, tp)
    # DLPerf's Megatron-LM runs on 1-4 nodes of 8 V100-16GB (one 100 Gbit/s port per node), each with its nvidia-smi
    # memory (docs/costmodel.md `dlperf`): a single V100 is predicted 7-10 % too slow (28-35 % while the eager
    # softmax's bytes were counted twice, constants.SOFTMAX_PASS_BYTES, and the V100 ran at the fraction fitted on
    # AMP's T4s, constants.MEASURED_GEMM_EFFICIENCY); the two TP groups that span nodes (TP 16 over 2 nodes, TP 32 over 4) were 4-5x too slow
    # while the model sent each of a node's 8 TP ranks' ring traffic through the node's one port; with the whole
    # port per group (one ring leaves a node once) they are too fast, by less than 0.7 (open)
    dl = sources["dlperf"]
    # 15 memory figures compared: TP 32's 9.26 GB is below the tensors its ranks hold (peak_memory_excluded,
    # test_costmodel_memory.py)
    assert (dl["n"], dl["memory_n"]) == (16, 15) and dl["spearman"] >= 0.9
    dl_runs = {r.name.removeprefix("dlperf-"): r.error or 0.0 for r in results if r.source == "dlperf"}
    for spanning in ("h3072-l16-dp1-tp16-pp1-mbs16-gbs16", "h3072-l32-dp1-tp32-pp1-mbs16-gbs16"):
        assert 0.0 < dl_runs[spanning] <= 0.7, spanning
    for single in ("h1536-l16-dp1-tp1-pp1-mbs2-gbs2", "h768-l12-dp1-tp1-pp1-mbs8-gbs8"):
        assert -0.12 <= dl_runs[single] <= -0.03, single
    # data parallelism over the nodes' ports: the step grows from 8 to 16 GPUs as measured (+0.18 s)
    by_name = {r.name: r for r in results}
    dp8, dp16 = (by_name[f"dlperf-h1536-l16-dp{d}-tp1-pp1-mbs2-gbs{2 * d}"] for d in (8, 16))
    assert dp8.predicted and dp16.predicted and dp8.measured and dp16.measured
    grown = (2 * 16 * 2048 / dp16.predicted) - (2 * 8 * 2048 / dp8.predicted)
    assert grown == pytest.approx((2 * 16 * 2048 / dp16.measured) - (2 * 8 * 2048 / dp8.measured), abs=0.03)
    # BigScience's tr3m-1B3 layout benchmark on 2 nodes of 4 V100-32GB / 16GB (27 rows, 4 out of memory), each run
    # with its nvidia-smi memory: open misses (docs/costmodel.md `tr3m`): every TP 1 run is predicted 8-25 % too
    # slow (28-37 % before the softmax bytes and the V100's measured matmul fraction, which were derived on DLPerf
    # without this source), the two TP 2 runs, which take the fork's torch softmax, within 15 %
    tr = sources["tr3m"]
    assert (tr["n"], tr["memory_n"]) == (23, 23) and tr["spearman"] >= 0.8
    tr_runs = {r.name.removeprefix("tr3m-"): r.error for r in results if r.source == "tr3m" and not r.out_of_memory}
    for name, err in tr_runs.items():
        assert err is not None
        assert (abs(err) <= 0.15) if "-tp2-" in name else (-0.25 <= err <= -0.08), (name, err)
    # its memory, read on the first node (measured.peak_memory_devices), with ZeRO-1's flat gradient bucket, the
    # torch softmax's fp32 output and the fp32 logits the pipe buffers keep: median within 8 %; the PP 1 / TP 1
    # readings stay 7-20 % above the model (open, docs/costmodel.md `tr3m`), every other row within 15 %
    assert tr["memory_median_abs_error"] <= 0.08 and tr["memory_max_abs_error"] <= 0.20
    for r in results:
        if r.source == "tr3m" and r.memory_error is not None and "-tp1-pp1-" not in r.name:
            assert abs(r.memory_error) <= 0.15, (r.name, r.memory_error)
    # BigScience's 176B search and BLOOM's training on 48 x 8 A100s, and tr1-13B on 128 x 4 V100s: 19 runs with
    # throughput (17 with the first node's memory), 3 reported as failed for memory
    assert (sources["bigscience"]["n"], sources["bigscience"]["memory_n"]) == (19, 17)
    # llm-foundry's FSDP runs on 64-512 GPUs: the model keeps tokens/s per GPU flat from 128 to 512 GPUs where
    # measured falls (open miss, docs/costmodel.md `mptscale`): the error grows with the GPU count
    by_name = {r.name: r for r in results}
    assert sources["mptscale"]["n"] == 21 and sources["mptscale"]["spearman"] >= 0.95
    for size in ("1b", "3b", "7b", "70b"):
        err = [by_name[f"mptscale-{size}-h100-g{g}"].error or 0.0 for g in (128, 256, 512)]
        assert err[0] < err[1] < err[2], (size, err)
    assert (sources["amp_t4"]["n"], sources["amp_mixed"]["n"]) == (47, 43)  # the runs of issue 9's table
    # ZeRO-3 (FSDP) of a 175B model over 992 A100s x TP 8 (OPT-175B): fits, and is not over-predicted
    # (issue 9's "up to 4x"); the measured figure is the paper's "up to 147 TFLOP/s", so the estimate is below it
    opt = by_name["opt-175b-a100-g992"]
    assert opt.fits and -0.10 <= (opt.error or 1.0) <= 0.0
    # fms-fsdp: the four batch-2 rows of one README table (34B / 70B, 128 A100s at 400 Gbit/s and 96 H100s at 800);
    # the H100 runs within 7 %, the A100 runs too slow (open miss: the same code reaches 2.2x the A100's tokens/s
    # on the H100 where the model gives 2.6x; docs/costmodel.md `fmsfsdp`), each about 5 points faster since full
    # recompute stops at the down projection as fms-fsdp's PyTorch checkpoint does (train.recompute_early_stop)
    assert sources["fmsfsdp"]["n"] == 4
    # MaxText on TPU v5e (16B-128B, FSDP over 1-32 slices of 256 chips) and v5p (32B-1024B, FSDP x TP 4-16 on 1-2
    # slices of 64-2048 chips): every run fits as it ran since XLA's memory has no CUDA reserve or allocator
    # fragmentation (constants.compiled_memory; the v5e 32B and 64B runs were refused at 17.5 of 16.1 GB before);
    # ranked in order; within 25 % at the fitted TPU matmul fraction, their matmuls a padded roofline (every run
    # 22-51 % too slow at the GPU figures, 0.59 of peak and the GPU shape term: docs/costmodel.md `maxtext`)
    mt = [r for r in results if r.source in ("maxtext_v5e", "maxtext_v5p")]
    assert len(mt) == 40 and all(r.fits and r.error is not None for r in mt)
    assert sources["maxtext_v5e"]["spearman"] >= 0.95 and sources["maxtext_v5p"]["spearman"] >= 0.9
    assert all(abs(r.error or 1.0) <= 0.25 for r in mt)
    # v5e from 1 to 32 slices: the rate per chip falls 10-17 % measured; the model's fall, since each chip's gradient
    # shard is all-reduced over the hosts' data-centre links (batch.sharded_sync_s), is 4-6 % at 128B and under 3 %
    # at 16-64B (open miss, docs/costmodel.md `maxtext`)
    def fall(size: str, key: str) -> float:
        one, many = by_name[f"maxtext_v5e-{size}-s1"], by_name[f"maxtext_v5e-{size}-s32"]
        return 1.0 - float(getattr(many, key)) / 32.0 / float(getattr(one, key))

    for size in ("16b", "32b", "64b", "128b"):
        assert 0.09 <= fall(size, "measured") <= 0.18, size
        assert (0.04 <= fall(size, "predicted") <= 0.06) if size == "128b" else (0.0 <= fall(size, "predicted") <= 0.03)
    for size in ("34b", "70b"):
        a100 = by_name[f"fmsfsdp-llama2-{size}-a100-g128"].error or 0.0
        h100 = by_name[f"fmsfsdp-llama2-{size}-h100-g96"].error or 1.0
        assert abs(h100) <= 0.07 and -0.16 <= a100 <= -0.07, (size, a100, h100)
    # Sailor's GH200 runs (4-256 GPUs, TF32): ranked in order, every one with its measured peak memory compared
    # but one log that its three twins contradict (measured.peak_memory_excluded, with the evidence)
    assert sources["sailor_gh200"]["n"] == 26 and sources["sailor_gh200"]["memory_n"] == 25
    assert sources["sailor_gh200"]["spearman"] >= 0.95
    sailor = sources["sailor"]
    assert sailor["n"] == 9 and sailor["memory_n"] == 7  # the two N2 logs are below what their ranks hold
    excluded = {r.name for r in results if r.memory_excluded}
    assert excluded == {"sailor-mit-n2-d1", "sailor-mit-n2-d2", "sailor_gh200-gptneo2.7b-n8-pp4-dp2-mbs4-gbs1024",
                        "dlperf-h3072-l32-dp1-tp32-pp1-mbs16-gbs16"}
    assert all(r.measured_memory_gb and r.memory_error is None for r in results if r.memory_excluded)
    # with the collectives Sailor's runtime reached (network.collective_gb_per_s) the worst cases are the 2-stage
    # pipelines with data parallelism whose first stage is the RTX 3090 node (TP 8 at 1.65 GB/s, then 0.92 Gbit/s
    # out), predicted 17-19 % too slow (open miss: docs/costmodel.md); the pure data-parallel runs (42-51 % too
    # fast before the measured collectives) are within 4 %
    sailor_runs = [r for r in results if r.source == "sailor"]
    worst = max(sailor_runs, key=lambda r: abs(r.error or 0.0))
    assert worst.name in {"sailor-mit-n4-d2", "sailor-mit-n6-d3"} and (worst.error or 0.0) < 0
    assert all(abs(by_name[f"sailor-mit-{n}"].error or 1.0) < 0.05 for n in ("n4-d4", "n6-d6"))
    # peak memory compared where measured: the 4-node pipeline within 15 % of Sailor's log
    r = by_name["sailor-mit-n4-d1"]
    assert r.memory_error is not None and abs(r.memory_error) < 0.15


def test_a_run_that_failed_for_memory_must_be_refused(tmp_path: Path) -> None:
    import yaml

    (tmp_path / "models").symlink_to(CASES / "models")
    data, _ = read_yaml(CASES / "megatron2021-gpt-1.7b.yaml")
    # the same model on one 24 GB card without recompute cannot fit: reported as failed for memory, the
    # estimate agrees, so the case passes ...
    data["train"]["recompute"] = "none"
    data["groups"][0]["stages"] = [{"accelerator": "rtx-4090", "tp": 1, "layers": 24}]
    data["groups"][0]["replicas"] = 1
    data["measured"] = {"out_of_memory": True}
    (tmp_path / "x-oom.yaml").write_text(yaml.safe_dump(data))
    r = run_case(tmp_path / "x-oom.yaml", CAT)
    assert r.ok and not r.fits and r.out_of_memory and r.error is None
    # ... while the published run that ran must fit, and claiming it failed for memory is a failed case
    data2, _ = read_yaml(CASES / "megatron2021-gpt-1.7b.yaml")
    data2["measured"] = {"out_of_memory": True}
    (tmp_path / "x-ran.yaml").write_text(yaml.safe_dump(data2))
    r2 = run_case(tmp_path / "x-ran.yaml", CAT)
    assert r2.fits and not r2.ok and "failed for memory, but the estimator says it fits" in (r2.reason or "")


def test_runs_before_flash_attention_match_with_eager_attention(tmp_path: Path) -> None:
    # Megatron-LM 2021 and Korthikanti 2022 predate FlashAttention (May 2022). The data files do not say so
    # (attention: auto runs flash on A100s), which over-predicts their small models most (scores are a larger
    # share of the work at small h). Stating eager attention removes that size trend.
    import numpy as np
    import yaml

    names = [p for p in find_cases([CASES]) if p.stem.startswith(("megatron2021", "korthikanti2022"))]
    assert len(names) == 18
    (tmp_path / "models").symlink_to(CASES / "models")
    errors = {}
    flash_errors = {}
    for p in names:
        flash_errors[p.stem] = run_case(p, CAT).error
        data, _ = read_yaml(p)
        data["train"]["attention"] = "eager"
        (tmp_path / p.name).write_text(yaml.safe_dump(data))
        r = run_case(tmp_path / p.name, CAT)
        assert r.ok, r.reason
        errors[p.stem] = r.error
    assert max(abs(e) for e in errors.values()) <= 0.23, errors  # 0.220 at SUSTAINED_FRACTION 0.74
    assert np.std(list(errors.values())) < 0.6 * np.std(list(flash_errors.values()))
    assert errors["megatron2021-gpt-1.7b"] < flash_errors["megatron2021-gpt-1.7b"] - 0.3


def test_spearman_matches_scipy_with_ties() -> None:
    x = [1.0, 2.0, 2.0, 5.0, 3.0, 9.0]
    y = [2.0, 1.0, 4.0, 4.0, 6.0, 7.0]
    assert spearman(x, y) == pytest.approx(spearmanr(x, y).statistic)
    assert spearman([1.0], [2.0]) != spearman([1.0], [2.0])  # NaN for one point


def test_summary_figures() -> None:
    rs = [CaseResult("a", "a", 110.0, 100.0, True), CaseResult("b", "b", 80.0, 100.0, True),
          CaseResult("c", "c", None, 100.0, False, "broken")]
    s = summarize(rs)
    assert s["n"] == 2
    assert s["median_abs_error"] == pytest.approx(0.15)
    assert s["max_abs_error"] == pytest.approx(0.2)
    assert rs[1].error == pytest.approx(-0.2)


def test_every_sailor_run_that_ran_fits_and_more_micro_batch_is_refused(results: list[CaseResult],
                                                                        tmp_path: Path) -> None:
    """Item 4 on Sailor's runs (MIT consumer cluster and GH200): each ran, so none may be refused; the same
    plans with a micro-batch 8x larger, reported as failed for memory, must be refused."""
    import yaml

    sailor = [r for r in results if r.source in ("sailor", "sailor_gh200")]
    assert len(sailor) == 35
    assert all(r.ok and r.fits for r in sailor), [(r.name, r.reason) for r in sailor if not (r.ok and r.fits)]
    for name in ("mixed-sailor-mit/sailor-mit-n2-d2", "mixed-sailor-mit/sailor-mit-n4-d4",
                 "sailor-clariden/sailor_gh200-opt350m-n16-pp1-dp16-mbs8-gbs1024"):
        folder, stem = name.split("/")
        data, _ = read_yaml(CASES / folder / f"{stem}.yaml")
        for g in data["groups"]:
            g["micro_batch"] *= 8
        data["train"]["global_batch"] *= 8
        data["measured"] = {"out_of_memory": True}
        if not (tmp_path / folder).exists():
            (tmp_path / folder).mkdir()
            (tmp_path / folder / "models").symlink_to(CASES / folder / "models")
        (tmp_path / folder / f"{stem}.yaml").write_text(yaml.safe_dump(data))
        r = run_case(tmp_path / folder / f"{stem}.yaml", CAT)
        assert r.ok and not r.fits and r.out_of_memory, (name, r.reason)


def test_a_device_wide_memory_figure_is_compared_with_the_whole_need() -> None:
    """Sailor's GH200 ``max_mem`` is the device's used memory (NVML: context, NCCL, allocator reserve); the
    others are PyTorch's allocated peak, compared with the need minus the fixed reserve."""
    from dataclasses import replace

    from starverse.costmodel import estimate
    from starverse.costmodel.constants import FRAGMENTATION_FRACTION, NCCL_NVLINK_COMMUNICATOR_GB, RESERVED_GB
    from starverse.costmodel.validate import load_case, score_case

    case = load_case(CASES / "sailor-clariden" / "sailor_gh200-opt350m-n1-pp1-dp1-mbs1-gbs32.yaml")
    assert case.measured.peak_memory_scope == "device"
    (stage,) = (s for g in estimate(case.plan, CAT, case.spec).groups for s in g.stages)
    need = stage.total_gb
    # the device's used memory: the reserve, the tensors, the caching allocator's free blocks, the buffers
    # of the three NCCL communicators over the node's 4 NVLink-connected GPUs (TP, model-parallel, world) and
    # the segment of DeepSpeed's flat gradient copy (0.41 GB of fp32 gradients at TP 4, above every activation
    # tensor of micro-batch 1)
    assert stage.flat_grad_segment_gb == pytest.approx(stage.grads_gb) and stage.grads_gb > 0.3
    device = (RESERVED_GB + (need - RESERVED_GB) * (1.0 + FRAGMENTATION_FRACTION)
              + 3 * NCCL_NVLINK_COMMUNICATOR_GB[3] + stage.grads_gb)
    assert score_case(case, CAT).predicted_memory_gb == pytest.approx(device)
    allocated = replace(case, measured=case.measured.model_copy(update={"peak_memory_scope": "allocated"}))
    assert score_case(allocated, CAT).predicted_memory_gb == pytest.approx(need - RESERVED_GB)


def test_nccl_communicators_counted_where_a_device_shares_them_with_nvlink_peers(results: list[CaseResult]) -> None:
    from starverse.costmodel.validate import nvlink_communicators

    # TP 4 filling a 4-GPU node: the TP group, the pipeline grid's model-parallel group and the world group; the
    # data-parallel and pipeline peers sit on other nodes
    assert nvlink_communicators(4, 1, 1, 4) == [4, 4, 4]
    assert nvlink_communicators(4, 8, 2, 4) == [4, 8, 64]
    # pure data parallelism on an 8-GPU node: the world and the data-parallel group
    assert nvlink_communicators(1, 8, 1, 8) == [8, 8]
    # TP 2 x 2 stages on one node: TP, model-parallel, world and the pipeline neighbours' pair
    assert nvlink_communicators(2, 1, 2, 8) == [2, 4, 4, 2]
    assert nvlink_communicators(1, 1, 1, 8) == []
    # only NVLink nodes: Sailor's MIT cards (PCIe) keep the fixed reserve alone; the GH200 (NVLink) runs come
    # within 10 % (OPT) and 13 % (GPT-Neo) of the device's used memory, but for one GPT-Neo log that is 9 GB
    # below its twins with the same stages (n8-pp4-dp2: 28.5 GB; n16/n32/n64-pp4: 37.3-37.5 GB)
    by_name = {r.name: r for r in results}
    gh200 = [r for r in results if r.source == "sailor_gh200"]
    # with the flat gradient copy's segment (test_a_flat_gradient_copy_takes_its_own_segment) every compared
    # GH200 log is within 7 %
    assert all(abs(r.memory_error or 1.0) < 0.07 for r in gh200 if not r.memory_excluded)
    from starverse.costmodel.validate import device_extra_gb, load_case

    mit = load_case(CASES / "mixed-sailor-mit" / "sailor-mit-n4-d1.yaml")
    assert [device_extra_gb(mit, 0, i, CAT) for i in range(4)] == [0.0] * 4
    gh = load_case(CASES / "sailor-clariden" / "sailor_gh200-opt350m-n4-pp4-dp1-mbs1-gbs64.yaml")
    assert device_extra_gb(gh, 0, 3, CAT) == pytest.approx(3 * 0.688)
    assert by_name["sailor-mit-n4-d1"].memory_error is not None


def test_a_flat_gradient_copy_takes_its_own_segment() -> None:
    """DeepSpeed without ZeRO flattens a stage's gradients (up to 5e8 values) for the all-reduce after the last
    backward: the peak holds the larger of that copy and the activations, and a device-wide reading also holds
    the copy's own allocator segment where no freed activation tensor is as large."""
    import numpy as np

    from starverse.costmodel import estimate
    from starverse.costmodel.constants import FLAT_ALLREDUCE_BUCKET_ELEMENTS
    from starverse.costmodel.memory import flat_grad_buffer_bytes
    from starverse.costmodel.validate import load_case, score_case

    assert float(flat_grad_buffer_bytes(4e8, 4.0)) == 4e8
    assert float(flat_grad_buffer_bytes(1e10, 2.0)) == FLAT_ALLREDUCE_BUCKET_ELEMENTS * 2.0
    assert np.allclose(flat_grad_buffer_bytes(np.array([1e6, 3e9]), 4.0), [1e6, 2e9])

    def stages(case: object) -> list:
        return [s for g in estimate(case.plan, CAT, case.spec).groups for s in g.stages]  # type: ignore[attr-defined]

    # GPT-Neo 2.7B, TP 4, micro-batch 1: 1.3 GB of fp32 gradients per device, above every activation tensor
    neo = load_case(CASES / "sailor-clariden" / "sailor_gh200-gptneo2.7b-n2-pp2-dp1-mbs1-gbs1.yaml")
    assert neo.plan.train.flat_grad_allreduce
    for s in stages(neo):
        assert s.flat_grad_segment_gb == pytest.approx(s.grads_gb)
    off = replace_train(neo, flat_grad_allreduce=False)
    assert all(s.flat_grad_segment_gb == 0.0 for s in stages(off))
    # below the activation peak the copy does not move the need (what fits is unchanged) ...
    assert [s.total_gb for s in stages(off)] == pytest.approx([s.total_gb for s in stages(neo)])
    # ... but the device-wide reading holds its segment on top
    assert (score_case(neo, CAT).predicted_memory_gb or 0.0) - (score_case(off, CAT).predicted_memory_gb or 0.0) \
        == pytest.approx(max(s.grads_gb for s in stages(neo)), rel=0.05)
    # OPT-350M at micro-batch 8: one layer's scores (8 x 4 heads x 2048^2 x 4 B = 0.54 GB) exceed the 0.1 GB copy,
    # which the freed block then holds: no segment of its own
    opt = load_case(CASES / "sailor-clariden" / "sailor_gh200-opt350m-n8-pp4-dp2-mbs8-gbs512.yaml")
    assert all(s.flat_grad_segment_gb == 0.0 for s in stages(opt))
    # a stage whose gradients exceed its activations: the copy sets the peak
    big = replace_train(load_case(CASES / "sailor-clariden" / "sailor_gh200-opt350m-n1-pp1-dp1-mbs1-gbs1.yaml"),
                        flat_grad_allreduce=True, seq_len=128)
    (s,) = stages(big)
    assert s.grads_gb > s.activations_gb
    assert s.total_gb == pytest.approx(s.weights_gb + s.grads_gb + s.optimizer_gb + s.grads_gb + 2.0, rel=1e-6)


def replace_train(case: object, **update: object) -> object:
    """A loaded case with some of its ``train`` fields replaced."""
    from dataclasses import replace

    plan = case.plan  # type: ignore[attr-defined]
    return replace(case, plan=plan.model_copy(update={"train": plan.train.model_copy(update=update)}))


def test_an_excluded_memory_log_is_reported_but_not_scored(tmp_path: Path) -> None:
    """``measured.peak_memory_excluded`` keeps the logged figure in the report with its reason, and out of the
    memory error and the per-source memory figures."""
    import yaml

    from starverse.costmodel.validate import report

    data, _ = read_yaml(CASES / "mixed-sailor-mit" / "sailor-mit-n4-d1.yaml")
    (tmp_path / "models").symlink_to(CASES / "mixed-sailor-mit" / "models")
    (tmp_path / "sailor-a.yaml").write_text(yaml.safe_dump(data))
    data["measured"]["peak_memory_excluded"] = "below its own parameters"
    (tmp_path / "sailor-b.yaml").write_text(yaml.safe_dump(data))
    a, b = run_case(tmp_path / "sailor-a.yaml", CAT), run_case(tmp_path / "sailor-b.yaml", CAT)
    assert a.memory_error is not None and b.memory_error is None and b.ok
    assert b.measured_memory_gb == a.measured_memory_gb and b.predicted_memory_gb == a.predicted_memory_gb
    doc = report([a, b])
    assert doc["sources"]["sailor"]["memory_n"] == 1
    assert [c["memory_excluded"] for c in doc["cases"]] == [None, "below its own parameters"]


def test_a_first_node_reading_compares_the_devices_of_the_first_node() -> None:
    """``measured.peak_memory_devices: first_node``: a reading taken on the job's first node (tr3m: nvidia-smi
    on one node; its out-of-memory twins show the reading is not the fullest device) is compared with the largest
    device among the first node's ranks, laid out TP fastest, then data parallel, then pipeline."""
    from dataclasses import replace

    from starverse.costmodel import estimate
    from starverse.costmodel.validate import (
        device_extra_gb,
        first_node_stages,
        load_case,
        peak_reading_gb,
        score_case,
    )

    tr3m = CASES / "bigscience-tr3m"
    expect = {"tp1-pp1-dp8": 1, "tp1-pp2-dp4": 1, "tp1-pp4-dp2": 2, "tp1-pp8-dp1": 4, "tp2-pp1-dp4": 1}
    for path in sorted(tr3m.glob("tr3m-*.yaml")):
        case = load_case(path)
        assert case.measured.out_of_memory or case.measured.peak_memory_devices == "first_node"
        layout = next(k for k in expect if k in path.stem)
        assert first_node_stages(case, CAT) == expect[layout], path.stem
    case = load_case(tr3m / "tr3m-32gb-tp1-pp4-dp2-mbs8.yaml")
    stages = estimate(case.plan, CAT, case.spec).groups[0].stages
    reading = [peak_reading_gb(s.total_gb, "device") + device_extra_gb(case, 0, i, CAT) + s.flat_grad_segment_gb
               for i, s in enumerate(stages)]
    got = score_case(case, CAT).predicted_memory_gb
    assert got == pytest.approx(max(reading[:2]))
    # the last stage (the logits, on the second node) is the fullest device: 16 GB cards ran out of memory there
    assert max(reading) == reading[-1] > 15.9 > (got or 0.0)
    every = replace(case, measured=case.measured.model_copy(update={"peak_memory_devices": "all"}))
    assert score_case(every, CAT).predicted_memory_gb == pytest.approx(max(reading))
