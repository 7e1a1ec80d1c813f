"""The hardware catalog: bundled data against the reference table, user overrides, probe profile, errors."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import pytest

from starverse.catalog import (
    FLOAT_FIELDS,
    Catalog,
    bundled_catalog,
    convert,
    default_profile_path,
    load_catalog,
)
from starverse.errors import CatalogError

REPO = Path(__file__).resolve().parents[2]

DESIGN_IDS = ["rtx-2080", "rtx-3090", "rtx-4090", "titan-rtx", "rtx-a6000", "l40s", "t4", "v100-16gb-sxm", "v100-32gb-sxm", "a100-40gb-sxm", "a100-80gb-sxm", "a100-80gb-pcie", "h100-80gb-sxm", "h100-80gb-pcie", "h200-141gb-sxm", "b200", "mi250x", "mi300x", "tpu-v4", "tpu-v5e", "tpu-v5p", "tpu-v6e", "ascend-910b", "mlu370-x8", "cpu"]

# data/reference/accelerators.csv row name -> catalog id (rows whose figures are plain numbers)
CSV_IDS = {
    "RTX 3090": "rtx-3090",
    "RTX 4090": "rtx-4090",
    "RTX A6000": "rtx-a6000",
    "L40S": "l40s",
    "A100 40GB SXM": "a100-40gb-sxm",
    "A100 80GB SXM": "a100-80gb-sxm",
    "A100 80GB PCIe": "a100-80gb-pcie",
    "A100 40GB PCIe": "a100-40gb-pcie",
    "H100 SXM5": "h100-80gb-sxm",
    "H100 PCIe": "h100-80gb-pcie",
    "H100 NVL": "h100-94gb-nvl",
    "H200 SXM": "h200-141gb-sxm",
    "B200 (HGX, 1000 W)": "b200",
    "MI250X (OAM, 2 GCDs)": "mi250x",
    "MI300X": "mi300x",
    "TPU v4": "tpu-v4",
    "TPU v5e": "tpu-v5e",
    "TPU v5p": "tpu-v5p",
    "TPU v6e (Trillium)": "tpu-v6e",
    "Cambricon MLU370-X8": "mlu370-x8",
}


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No user catalog, no profile from the real home directory."""
    monkeypatch.delenv("STARVERSE_CATALOG", raising=False)
    monkeypatch.delenv("STARVERSE_PROFILE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))


@pytest.fixture
def cat() -> Catalog:
    return load_catalog()


def _num(text: str) -> float | None:
    m = re.fullmatch(r"\s*([0-9.]+)\s*", text)
    return float(m.group(1)) if m else None


# ---- bundled data ----------------------------------------------------------------------------------
def test_every_design_id_is_in_the_catalog(cat: Catalog) -> None:
    missing = [i for i in DESIGN_IDS if i not in cat.accelerators]
    assert missing == []


def test_every_figure_has_a_source(cat: Catalog) -> None:
    for acc in cat.accelerators.values():
        for name in (*FLOAT_FIELDS, "devices_per_node", "intra_node_link"):
            if name == "fp8_tflops" and acc.fp8_tflops is None:
                continue
            source = acc.sources.get(name, "")
            assert len(source) > 10 and not source.startswith("set in"), (acc.id, name)


def test_dense_figures_match_the_reference_table(cat: Catalog) -> None:
    """bf16 (dense), fp8 (dense), memory and bandwidth agree with data/reference/accelerators.csv."""
    rows = list(csv.DictReader((REPO / "data/reference/accelerators.csv").open()))
    checked = 0
    for row in rows:
        acc_id = CSV_IDS.get(row["accelerator"])
        if acc_id is None:
            continue
        acc = cat.accelerator(acc_id)
        for column, value in (
            ("bf16_dense_tflops", acc.bf16_tflops),
            ("fp8_dense_tflops", acc.fp8_tflops),
            ("mem_bw_GBps", acc.memory_bw_gb_per_s),
        ):
            ref = _num(row[column])
            if ref is not None:
                assert value == pytest.approx(ref, rel=0.002), (acc_id, column)
                checked += 1
        sparse = _num(row["bf16_sparse_tflops"])
        if sparse is not None:
            # the classic mistake: the 2:4-sparse figure quoted as the peak
            assert acc.bf16_tflops < 0.6 * sparse, acc_id
    assert checked >= 40


def test_geforce_uses_fp32_accumulate_rate_and_turing_has_no_bf16(cat: Catalog) -> None:
    assert cat.accelerator("rtx-4090").bf16_tflops == 165.2  # not 330.3 (FP16 accumulate)
    assert cat.accelerator("rtx-3090").fp16_tflops == 71
    for acc_id in ("rtx-2080", "t4", "v100-32gb-sxm"):
        acc = cat.accelerator(acc_id)
        assert acc.bf16_tflops == acc.fp32_tflops < acc.fp16_tflops


def test_links_are_per_direction(cat: Catalog) -> None:
    a100 = cat.accelerator("a100-80gb-sxm")
    assert (a100.intra_node_link, a100.intra_node_gb_per_s) == ("nvlink", 300)
    assert cat.accelerator("h100-80gb-sxm").intra_node_gb_per_s == 450
    assert cat.accelerator("rtx-4090").intra_node_link == "pcie"


def test_stacks_and_backends(cat: Catalog) -> None:
    assert cat.accelerator("tpu-v5e").backend == "xla"
    assert cat.accelerator("ascend-910b").backend == "hccl"
    assert cat.accelerator("mi300x").backend == "rccl"
    assert cat.accelerator("mlu370-x8").backend == "cncl"
    assert cat.accelerator("cpu").backend == "gloo"


def test_ascend_is_flagged_low_confidence(cat: Catalog) -> None:
    assert "LOW CONFIDENCE" in cat.accelerator("ascend-910b").sources["bf16_tflops"]


def test_peak_tflops_by_precision(cat: Catalog) -> None:
    h100 = cat.accelerator("h100-80gb-sxm")
    assert h100.peak_tflops("fp8") == 1979
    assert h100.peak_tflops("fp32") == pytest.approx(66.9)
    a100 = cat.accelerator("a100-80gb-sxm")
    assert a100.fp8_tflops is None and a100.peak_tflops("fp8") == 312  # falls back to bf16
    with pytest.raises(CatalogError, match=r"unknown precision 'int4' for accelerator 'a100-80gb-sxm'; use one of"):
        a100.peak_tflops("int4")


def test_unknown_accelerator_suggests_and_says_how_to_add(cat: Catalog) -> None:
    with pytest.raises(CatalogError) as e:
        cat.accelerator("rtx-4080")
    msg = str(e.value)
    assert msg.startswith("unknown accelerator 'rtx-4080'; did you mean 'rtx-4090'")
    assert "--catalog FILE" in msg and "accelerators:" in msg
    with pytest.raises(CatalogError, match=r"unknown accelerator 'zzzz'; known: a100-40gb-pcie, "):
        cat.accelerator("zzzz")


# ---- prices and currencies --------------------------------------------------------------------------
def _offer(cat: Catalog, provider: str, acc: str):
    (offer,) = [o for o in cat.offers if o.provider == provider and o.accelerator == acc]
    return offer


def test_product_brief_prices(cat: Catalog) -> None:
    s1 = "product brief (scenario 1)"
    for acc, od, spot in (("rtx-4090", 1.2, 0.5), ("tpu-v5e", 2.8, 0.8), ("ascend-910b", 1.5, 0.6)):
        o = _offer(cat, s1, acc)
        assert (o.price_per_hour, o.spot_price_per_hour, o.currency) == (od, spot, "CNY")
    s2 = "product brief (scenario 2, monthly)"
    for acc, devices, per_month in (("a100-80gb-sxm", 128, 110_000), ("h100-80gb-pcie", 96, 95_000),
                                    ("rtx-4090", 160, 18_000)):
        o = _offer(cat, s2, acc)
        assert o.price_per_hour * devices * 730 == pytest.approx(per_month, rel=1e-4)
        assert "730" in o.source
    assert _offer(cat, "product brief (scenario 3)", "tpu-v5p").price_per_hour == 4.5
    assert _offer(cat, "product brief (scenario 3)", "rtx-4090").price_per_hour * 160 * 24 == pytest.approx(1800)


def test_reference_prices_are_offers(cat: Catalog) -> None:
    gcp = _offer(cat, "GCP", "h100-80gb-sxm")
    assert (gcp.price_per_hour, gcp.spot_price_per_hour, gcp.as_of) == (3.0, 2.25, "2026-03")
    assert _offer(cat, "GCP", "tpu-v6e").price_per_hour == 2.7
    for o in cat.offers:
        assert o.price_per_hour > 0 and o.billing_granularity_s > 0 and o.source and o.as_of
        assert o.spot_price_per_hour is None or o.spot_price_per_hour <= o.price_per_hour


def test_convert_uses_the_rate_table(cat: Catalog) -> None:
    assert convert(1.2, "CNY", "USD") == pytest.approx(1.2 * 0.136998)
    assert convert(100, "usd", "eur") == pytest.approx(100 / 1.0389)
    assert convert(convert(7.0, "GBP", "JPY"), "JPY", "GBP") == pytest.approx(7.0)
    assert cat.convert(5, "EUR", "EUR") == 5


def test_unknown_currency(cat: Catalog) -> None:
    with pytest.raises(CatalogError, match=r"unknown currency 'XYZ'; known: CNY, EUR, GBP, JPY, USD\. To add one"):
        convert(1, "XYZ", "USD")
    with pytest.raises(CatalogError, match=r"unknown currency 'USDT'; did you mean 'USD'\?"):
        cat.convert(1, "USD", "USDT")


def test_cheapest_offer_compares_across_currencies(cat: Catalog) -> None:
    # 0.5 CNY (brief spot) ~ 0.068 USD beats RunPod's 0.34 USD spot
    spot = cat.cheapest_offer("rtx-4090", spot=True)
    assert spot is not None and spot.provider == "product brief (scenario 1)"
    assert cat.cheapest_offer("b200") is None


# ---- user catalog files ------------------------------------------------------------------------------
def _write(tmp_path: Path, text: str, name: str = "mine.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


NEW_ACC = """\
accelerators:
  my-npu:
    name: My NPU
    vendor: acme
    stack: npu
    bf16_tflops: 100
    fp16_tflops: 100
    fp32_tflops: 25
    memory_gb: 32
    memory_bw_gb_per_s: 1000
    intra_node_link: hccs
    intra_node_gb_per_s: 50
    devices_per_node: 8
    inter_node_gbps: 200
    tdp_w: 300
    sources: {"bf16_tflops, fp16_tflops": "our benchmark"}
offers:
  - {provider: us, accelerator: my-npu, price_per_hour: 1.0, currency: EUR, as_of: "2026-11", source: "contract"}
"""


def test_user_file_adds_an_accelerator_and_offer(tmp_path: Path) -> None:
    cat = load_catalog(_write(tmp_path, NEW_ACC))
    acc = cat.accelerator("my-npu")
    assert acc.bf16_tflops == 100 and acc.fp8_tflops is None
    assert acc.sources["fp16_tflops"] == "our benchmark"
    assert acc.sources["tdp_w"] == "set in mine.yaml"
    assert cat.offers_for("my-npu")[0].currency == "EUR"
    assert len(cat.accelerators) == len(bundled_catalog().accelerators) + 1


def test_partial_override_changes_only_given_fields(tmp_path: Path) -> None:
    p = _write(tmp_path, "accelerators:\n  rtx-4090:\n    inter_node_gbps: 25\n    sources: {inter_node_gbps: my rack}\n")
    base = bundled_catalog().accelerator("rtx-4090")
    acc = load_catalog(p).accelerator("rtx-4090")
    assert acc.inter_node_gbps == 25 and acc.sources["inter_node_gbps"] == "my rack"
    assert acc.bf16_tflops == base.bf16_tflops and acc.sources["bf16_tflops"] == base.sources["bf16_tflops"]


def test_offer_with_same_provider_replaces_and_env_then_path_order(tmp_path: Path, monkeypatch) -> None:
    env = _write(tmp_path, "offers:\n  - {provider: GCP, accelerator: tpu-v5e, price_per_hour: 1.0, "
                 "as_of: '2026-11', source: env}\n", "env.yaml")
    arg = _write(tmp_path, "offers:\n  - {provider: GCP, accelerator: tpu-v5e, price_per_hour: 0.9, "
                 "as_of: '2026-11', source: arg}\n", "arg.yaml")
    monkeypatch.setenv("STARVERSE_CATALOG", str(env))
    gcp = [o for o in load_catalog().offers if o.provider == "GCP" and o.accelerator == "tpu-v5e"]
    assert [(o.price_per_hour, o.source) for o in gcp] == [(1.0, "env")]
    gcp = [o for o in load_catalog(arg).offers if o.provider == "GCP" and o.accelerator == "tpu-v5e"]
    assert [(o.price_per_hour, o.source) for o in gcp] == [(0.9, "arg")]


def test_user_currency_rate(tmp_path: Path) -> None:
    p = _write(tmp_path, "currencies:\n  CHF: {usd_per_unit: 1.1, as_of: '2026-11-01', source: bank}\n")
    assert load_catalog(p).convert(10, "CHF", "USD") == pytest.approx(11)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "accelerators:\n  rtx-4090:\n    bf16_tflops: 1\n   tdp_w: 3\n",
            r"mine\.yaml:4: malformed YAML: did not find expected key",
        ),
        (
            "offers:\n  - {provider: x, accelerator: rtx-4090, price_per_hour: -1, as_of: '1', source: s}\n",
            r"^[^\n]*mine\.yaml:2: offers\[0\]\.price_per_hour: must be greater than 0 \(got -1\)\. To fix: give a number more than 0$",
        ),
        (
            "offers:\n  - {provider: x, accelerator: rtx-4090, price_per_hour: 1, spot_price_per_hour: 0, "
            "as_of: '1', source: s}\n",
            r"mine\.yaml:2: offers\[0\]\.spot_price_per_hour: must be greater than 0 \(got 0\)",
        ),
        (
            "accelerators:\n  rtx-4090:\n    devices_per_node: 0\n",
            r"mine\.yaml:3: accelerators\.rtx-4090\.devices_per_node: must be greater than 0 \(got 0\)",
        ),
        (
            "accelerators:\n  tpu-v5e:\n    matrix_unit: 0\n",
            r"mine\.yaml:3: accelerators\.tpu-v5e\.matrix_unit: must be greater than 0 \(got 0\)",
        ),
        (
            "accelerators:\n  rtx-4090:\n    bf16_tflop: 100\n",
            r"mine\.yaml:3: accelerators\.rtx-4090\.bf16_tflop: unknown field; did you mean 'bf16_tflops'\?",
        ),
        (
            "accelerators:\n  rtx-4090:\n    stack: cudaa\n",
            r"mine\.yaml:3: accelerators\.rtx-4090\.stack: must be 'cuda', 'rocm', ",
        ),
        (
            "accelerators:\n  my-gpu:\n    bf16_tflops: 10\n",
            r"mine\.yaml:2: accelerators\.my-gpu: new accelerator is missing name, vendor, stack, fp16_tflops",
        ),
        (
            "offers:\n  - {provider: x, accelerator: rtx-4080, price_per_hour: 1, as_of: '1', source: s}\n",
            r"mine\.yaml:2: offers: unknown accelerator 'rtx-4080'; did you mean 'rtx-4090'",
        ),
        (
            "offers:\n  - {provider: x, accelerator: rtx-4090, price_per_hour: 1, currency: XYZ, as_of: '1', "
            "source: s}\n",
            r"mine\.yaml:2: offers: unknown currency 'XYZ'; known: ",
        ),
        (
            "offers:\n  - {provider: x, accelerator: rtx-4090, price_per_hour: 1, spot_price_per_hour: 2, "
            "as_of: '1', source: s}\n",
            r"mine\.yaml:2: offers: spot_price_per_hour \(2\.0\) is above price_per_hour \(1\.0\)",
        ),
        (
            "accelerators:\n  rtx-4090:\n    sources: {bf16_tflopz: x}\n",
            r"mine\.yaml:2: sources: unknown field 'bf16_tflopz'",
        ),
        (
            "currencies:\n  CHF: {usd_per_unit: -1, as_of: '1', source: s}\n",
            r"mine\.yaml:2: currencies\.CHF\.usd_per_unit: must be greater than or equal to 0\.000000001 \(got -1\)\. To fix: give a number at least 1e-09",
        ),
        ("offerz: []\n", r"mine\.yaml:1: offerz: unknown field; did you mean 'offers'\?"),
    ],
)
def test_malformed_catalog_files(tmp_path: Path, text: str, expected: str) -> None:
    with pytest.raises(CatalogError, match=expected) as e:
        load_catalog(_write(tmp_path, text))
    assert "\n" not in str(e.value)


def test_missing_catalog_file(tmp_path: Path) -> None:
    with pytest.raises(CatalogError, match=r"nope\.yaml: file not found"):
        load_catalog(tmp_path / "nope.yaml")


# ---- probe profile and overrides ---------------------------------------------------------------------
def _profile(path: Path, figures: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"version": 1, "host": "box", "measured_at": "2026-11-30T08:00:00Z",
                                "accelerators": figures}))
    return path


def test_profile_replaces_cpu_figures(tmp_path: Path) -> None:
    p = _profile(tmp_path / "p.json", {"cpu": {"fp32_tflops": 1.7, "bf16_tflops": 0.9, "memory_gb": 64}})
    cpu = load_catalog(profile=p).accelerator("cpu")
    assert (cpu.fp32_tflops, cpu.bf16_tflops, cpu.memory_gb) == (1.7, 0.9, 64)
    assert cpu.sources["fp32_tflops"] == "measured by starverse probe on box at 2026-11-30T08:00:00Z"
    assert cpu.memory_bw_gb_per_s == bundled_catalog().accelerator("cpu").memory_bw_gb_per_s


def test_profile_from_env_and_default_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert default_profile_path() == tmp_path / "home" / ".cache" / "starverse" / "profile.json"
    _profile(default_profile_path(), {"cpu": {"fp32_tflops": 2.5}})
    assert load_catalog().accelerator("cpu").fp32_tflops == 2.5
    assert load_catalog(profile="").accelerator("cpu").fp32_tflops == 0.5  # "" = no profile
    other = _profile(tmp_path / "other.json", {"cpu": {"fp32_tflops": 3.5}})
    monkeypatch.setenv("STARVERSE_PROFILE", str(other))
    assert load_catalog().accelerator("cpu").fp32_tflops == 3.5
    monkeypatch.setenv("STARVERSE_PROFILE", "")
    assert load_catalog().accelerator("cpu").fp32_tflops == 0.5


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("{not json", r"p\.json:1: malformed probe profile JSON: .*rerun `starverse probe`"),
        (json.dumps({"version": 2, "host": "h", "measured_at": "t"}), r"p\.json: version: must be 1"),
        (json.dumps({"version": 1, "host": "h", "measured_at": "t", "accelerators": {"cpu": {"flops": 1}}}),
         r"p\.json: accelerators\.cpu\.flops: unknown figure; a profile may hold bf16_tflops, "),
        (json.dumps({"version": 1, "host": "h", "measured_at": "t", "accelerators": {"gpu9": {"tdp_w": 1}}}),
         r"p\.json: accelerators\.gpu9: not in the catalog, and the profile alone cannot describe it"),
        (json.dumps({"version": 1, "host": "h", "measured_at": "t", "accelerators": {"cuda-x": {"tdp_w": 1}}}),
         r"accelerators\.cuda-x: not in the catalog, .* describe it in a catalog file \(--catalog FILE\)"),
    ],
)
def test_malformed_profiles(tmp_path: Path, content: str, expected: str) -> None:
    p = tmp_path / "p.json"
    p.write_text(content)
    with pytest.raises(CatalogError, match=expected):
        load_catalog(profile=p)


def test_missing_profile_named_explicitly(tmp_path: Path) -> None:
    with pytest.raises(CatalogError, match=r"probe profile not found; run `starverse probe`"):
        load_catalog(profile=tmp_path / "none.json")


def test_with_overrides_copies(cat: Catalog) -> None:
    new = cat.with_overrides({"rtx-4090": {"bf16_tflops": 150.0, "devices_per_node": 4}})
    assert new.accelerator("rtx-4090").bf16_tflops == 150.0
    assert new.accelerator("rtx-4090").devices_per_node == 4
    assert new.accelerator("rtx-4090").sources["bf16_tflops"] == "override"
    assert cat.accelerator("rtx-4090").bf16_tflops == 165.2  # the original is untouched
    with pytest.raises(CatalogError, match=r"unknown accelerator 'rtx-409'"):
        cat.with_overrides({"rtx-409": {"bf16_tflops": 1.0}})
    with pytest.raises(CatalogError, match=r"unknown field 'name'"):
        cat.with_overrides({"rtx-4090": {"name": 1.0}})


def test_catalog_is_immutable(cat: Catalog) -> None:
    with pytest.raises(TypeError):
        cat.accelerators["x"] = cat.accelerator("cpu")  # type: ignore[index]
    with pytest.raises(AttributeError):
        cat.accelerator("cpu").tdp_w = 1  # type: ignore[misc]


def test_catalog_pickles_and_copies(cat: Catalog) -> None:
    """Runtime processes receive the catalog by pickling; deep copies and asdict must work too."""
    import copy
    import dataclasses
    import pickle

    again = pickle.loads(pickle.dumps(cat))
    assert again == cat and hash(again) == hash(cat)
    assert copy.deepcopy(cat).accelerator("tpu-v5e").bf16_tflops == 197
    assert dataclasses.asdict(cat.accelerator("cpu"))["sources"]["fp32_tflops"].startswith("conservative")


def test_changed_user_file_is_read_again(tmp_path: Path) -> None:
    """load_catalog caches its result; editing the file must not serve stale figures."""
    p = _write(tmp_path, "accelerators:\n  t4:\n    tdp_w: 75\n")
    assert load_catalog(p).accelerator("t4").tdp_w == 75
    assert load_catalog(p) is load_catalog(p)
    p.write_text("accelerators:\n  t4:\n    tdp_w: 123\n")
    assert load_catalog(p).accelerator("t4").tdp_w == 123


def test_profile_ignores_failed_measurements(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A 0 from a failed measurement keeps the catalog figure (and says so) instead of breaking every command."""
    p = _profile(tmp_path / "p.json", {"cpu": {"memory_gb": 0.0, "fp32_tflops": 1.5}})
    cpu = load_catalog(profile=p).accelerator("cpu")
    assert (cpu.memory_gb, cpu.fp32_tflops) == (16, 1.5)
    assert "ignoring non-positive measured memory_gb" in caplog.text


def test_profile_adds_a_device_the_catalog_lacks(tmp_path: Path) -> None:
    """`starverse probe` names an unknown GPU `cuda-<name>`: the profile alone then describes it."""
    p = _profile(tmp_path / "p.json", {"cuda-nvidia-rtx-5090": {
        "bf16_tflops": 180.0, "fp32_tflops": 90.0, "memory_gb": 32.0, "memory_bw_gb_per_s": 1500.0}})
    acc = load_catalog(profile=p).accelerator("cuda-nvidia-rtx-5090")
    assert (acc.stack, acc.bf16_tflops, acc.fp16_tflops, acc.memory_gb, acc.memory_bw_gb_per_s) == (
        "cuda", 180.0, 180.0, 32.0, 1500.0)
    assert acc.sources["bf16_tflops"].startswith("measured by starverse probe")
    assert acc.sources["tdp_w"].startswith("assumed default")
