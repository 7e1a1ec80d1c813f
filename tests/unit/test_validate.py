"""The cost model against the published runs in data/validation (targets of issue 2)."""

from __future__ import annotations

from pathlib import Path

import pytest
from scipy.stats import spearmanr

from starverse.catalog import load_catalog
from starverse.config import read_yaml
from starverse.costmodel.validate import CaseResult, find_cases, run_case, spearman, summarize

CASES = Path(__file__).resolve().parents[2] / "data" / "validation"
CAT = load_catalog()


@pytest.fixture(scope="module")
def results() -> list[CaseResult]:
    return [run_case(p, CAT) for p in find_cases([CASES])]


def test_every_published_case_is_estimated_and_fits(results: list[CaseResult]) -> None:
    assert len(results) == len(list(CASES.glob("*.yaml"))) > 30
    failed = [(r.name, r.reason) for r in results if not r.ok]
    assert failed == []


def test_rank_correlation_target(results: list[CaseResult]) -> None:
    assert summarize(results)["spearman"] >= 0.9


def test_error_targets(results: list[CaseResult]) -> None:
    # issue 2: median <= 10 %, p90 <= 20 %, max <= 30 % on tokens/s (measured at commit: 7.2 %, 16.7 %, 30.0 %)
    s = summarize(results)
    assert s["median_abs_error"] <= 0.10
    assert s["p90_abs_error"] <= 0.20
    assert s["max_abs_error"] <= 0.30


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
    assert max(abs(e) for e in errors.values()) <= 0.21, errors
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
