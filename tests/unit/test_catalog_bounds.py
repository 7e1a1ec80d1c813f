"""A user's catalog file or probe profile cannot give a figure no device has: every number is finite, more
than 0 and under a physical bound (``config.MAX_*``), and the one error line names the file, its line, the
field and the bound."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from starverse.catalog import load_catalog
from starverse.errors import CatalogError

ACC = "accelerators:\n  rtx-4090:\n    {field}: {value}\n"
OFFER = "offers:\n  - {{provider: x, accelerator: rtx-4090, {field}: {value}, as_of: '1', source: s}}\n"
RATE = "currencies:\n  CHF: {{{field}: {value}, as_of: '1', source: s}}\n"

CASES: list[tuple[str, str, str, str, str]] = [
    # (template, field, value, where, a part of the message)
    (ACC, "bf16_tflops", "1.0e+300", "mine.yaml:3: accelerators.rtx-4090.bf16_tflops",
     "must be less than or equal to 1000000 (got 1e+300). To fix: give a number at most 1000000"),
    (ACC, "fp8_tflops", "2.0e6", "mine.yaml:3: accelerators.rtx-4090.fp8_tflops", "at most 1000000"),
    (ACC, "fp32_tflops", ".inf", "mine.yaml:3: accelerators.rtx-4090.fp32_tflops", "must be a finite number"),
    (ACC, "fp16_tflops", ".nan", "mine.yaml:3: accelerators.rtx-4090.fp16_tflops", "must be a finite number"),
    (ACC, "bf16_tflops", "0", "mine.yaml:3: accelerators.rtx-4090.bf16_tflops", "more than 0"),
    (ACC, "memory_gb", "1.0e300", "mine.yaml:3: accelerators.rtx-4090.memory_gb", "at most 100000"),
    (ACC, "memory_gb", "-80", "mine.yaml:3: accelerators.rtx-4090.memory_gb", "more than 0"),
    (ACC, "memory_bw_gb_per_s", "1.0e9", "mine.yaml:3: accelerators.rtx-4090.memory_bw_gb_per_s", "at most 100000"),
    (ACC, "intra_node_gb_per_s", "1.0e9", "mine.yaml:3: accelerators.rtx-4090.intra_node_gb_per_s",
     "at most 12500"),
    (ACC, "inter_node_gbps", "1.0e300", "mine.yaml:3: accelerators.rtx-4090.inter_node_gbps", "at most 100000"),
    (ACC, "tdp_w", "1.0e7", "mine.yaml:3: accelerators.rtx-4090.tdp_w", "at most 100000"),
    (ACC, "host_memory_gb", "1.0e300", "mine.yaml:3: accelerators.rtx-4090.host_memory_gb", "at most 100000"),
    (OFFER, "price_per_hour", "1.0e300", "mine.yaml:2: offers[0].price_per_hour", "at most 1000000000000"),
    (OFFER, "price_per_hour", ".nan", "mine.yaml:2: offers[0].price_per_hour", "must be a finite number"),
    (RATE, "usd_per_unit", "1.0e-300", "mine.yaml:2: currencies.CHF.usd_per_unit", "at least 1e-09"),
    (RATE, "usd_per_unit", "1.0e300", "mine.yaml:2: currencies.CHF.usd_per_unit", "at most 1000000"),
    (RATE, "usd_per_unit", "0", "mine.yaml:2: currencies.CHF.usd_per_unit", "at least 1e-09"),
]


@pytest.mark.parametrize(("template", "field", "value", "where", "words"), CASES,
                         ids=[f"{c[1]}={c[2]}" for c in CASES])
def test_an_absurd_catalog_figure_is_one_line_naming_file_line_and_field(
        tmp_path: Path, template: str, field: str, value: str, where: str, words: str) -> None:
    path = tmp_path / "mine.yaml"
    path.write_text(template.format(field=field, value=value))
    with pytest.raises(CatalogError) as e:
        load_catalog(path, profile="")
    text = str(e.value)
    assert text.startswith(str(tmp_path / where) + ": ") and words in text and "\n" not in text, text


def test_figures_at_the_bounds_load(tmp_path: Path) -> None:
    path = tmp_path / "mine.yaml"
    path.write_text("accelerators:\n  rtx-4090:\n    bf16_tflops: 1000000\n    memory_gb: 100000\n"
                    "currencies:\n  CHF: {usd_per_unit: 1.0e-9, as_of: '1', source: s}\n")
    cat = load_catalog(path, profile="")
    assert cat.accelerators["rtx-4090"].bf16_tflops == 1e6 and cat.accelerators["rtx-4090"].memory_gb == 1e5
    assert cat.currencies["CHF"].usd_per_unit == 1e-9


@pytest.mark.parametrize(("figures", "words"), [
    ({"bf16_tflops": 1e300}, "accelerators.rtx-4090.bf16_tflops: must be less than or equal to 1000000"),
    ({"memory_bw_gb_per_s": 5e5}, "accelerators.rtx-4090.memory_bw_gb_per_s: must be less than or equal to 100000"),
    ({"devices_per_node": 2.5}, "accelerators.rtx-4090.devices_per_node: must be a valid integer"),
])
def test_an_absurd_measured_figure_in_the_profile_is_refused(tmp_path: Path, figures: dict[str, float],
                                                             words: str) -> None:
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"version": 1, "host": "box", "measured_at": "now",
                                "accelerators": {"rtx-4090": figures}}))
    with pytest.raises(CatalogError) as e:
        load_catalog(profile=path)
    assert str(e.value).startswith(f"{path}: {words}") and "rerun `starverse probe`" in str(e.value)
