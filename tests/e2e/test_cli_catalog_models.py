"""`starverse catalog` and `starverse models` as a user runs them (subprocess)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _bin() -> list[str]:
    exe = Path(sys.executable).parent / "starverse"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "starverse.cli"]


@pytest.fixture
def run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    env = {k: v for k, v in os.environ.items() if k not in ("STARVERSE_CATALOG", "STARVERSE_PROFILE")}
    env["HOME"] = str(tmp_path / "home")  # no real probe profile

    def _run(*args: str, extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*_bin(), *args], capture_output=True, text=True, env={**env, **(extra_env or {})}, cwd=tmp_path,
            timeout=120, check=False,
        )

    return _run


def test_catalog_table(run) -> None:
    r = run("catalog")
    assert r.returncode == 0, r.stderr
    row = next(line for line in r.stdout.splitlines() if " rtx-4090 " in line)
    cells = [c.strip() for c in row.strip("│ ").split("│")]
    assert cells[:9] == ["rtx-4090", "nvidia", "165.2", "24", "1008", "pcie", "32", "450", "cuda"]
    # cheapest hourly price (monthly/daily packages are not hourly ones): the brief's 1.2 CNY = 0.164 USD
    # on-demand; spot 0.5 CNY = 0.068 USD
    assert cells[9:] == ["0.164", "0.068"]
    for acc_id in ("tpu-v5e", "ascend-910b", "mlu370-x8", "cpu"):
        assert f" {acc_id} " in r.stdout


def test_catalog_json_and_currency(run) -> None:
    r = run("catalog", "--json", "--currency", "cny")
    data = json.loads(r.stdout)
    accs = {a["id"]: a for a in data["accelerators"]}
    assert accs["h100-80gb-sxm"]["bf16_tflops"] == 989.4
    assert "source" not in accs["h100-80gb-sxm"] and "hmc-tech" in accs["h100-80gb-sxm"]["sources"]["bf16_tflops"]
    spot = accs["rtx-4090"]["cheapest_spot"]
    assert spot["currency"] == "CNY" and spot["price_per_hour"] == pytest.approx(0.5)
    assert data["currencies"]["CNY"]["usd_per_unit"] == 0.136998
    assert any(o["provider"] == "GCP" and o["accelerator"] == "tpu-v6e" for o in data["offers"])


def test_catalog_prices(run) -> None:
    r = run("catalog", "--prices")
    assert r.returncode == 0, r.stderr
    assert "product brief (scenario 2, monthly)" in r.stdout and "2628000 s" in r.stdout


def test_user_catalog_and_profile(run, tmp_path: Path) -> None:
    mine = tmp_path / "mine.yaml"
    mine.write_text("accelerators:\n  rtx-4090:\n    memory_gb: 23\n")
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps({"version": 1, "host": "h", "measured_at": "t",
                                "accelerators": {"cpu": {"fp32_tflops": 1.25}}}))
    data = json.loads(run("catalog", "--json", "--catalog", str(mine), "--profile", str(prof)).stdout)
    accs = {a["id"]: a for a in data["accelerators"]}
    assert accs["rtx-4090"]["memory_gb"] == 23 and accs["cpu"]["fp32_tflops"] == 1.25
    # the same through the environment; the table marks measured rows
    r = run("catalog", extra_env={"STARVERSE_CATALOG": str(mine), "STARVERSE_PROFILE": str(prof)})
    assert " cpu * " in r.stdout and "measured by `starverse probe`" in r.stdout
    row = next(line for line in r.stdout.splitlines() if " rtx-4090 " in line)
    assert "│     23 │" in row


def test_catalog_errors_are_one_line_exit_2(run, tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("offers:\n  - provider: x\n    accelerator: rtx-4090\n    price_per_hour: 0\n"
                   "    as_of: '2026'\n    source: s\n")
    r = run("catalog", "--catalog", str(bad))
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [
        f"error: {bad}:4: offers[0].price_per_hour: must be greater than 0 (got 0). To fix: give a number more than 0"
    ]
    r = run("catalog", "--currency", "XYZ")
    assert r.returncode == 2 and r.stderr.startswith("error: unknown currency 'XYZ'; known: CNY, EUR")


def test_models_table_and_json(run) -> None:
    r = run("models")
    assert r.returncode == 0, r.stderr
    row = next(line for line in r.stdout.splitlines() if " mixtral-8x7b " in line)
    assert "46.703 (12.9 active)" in row and "2/8" in row and "32/8" in row
    data = json.loads(run("models", "--json").stdout)
    by_id = {m["id"]: m for m in data}
    assert by_id["llama-2-70b"]["num_params"] == 68_976_648_192
    assert by_id["llama-2-70b"]["hf_id"] == "meta-llama/Llama-2-70b-hf"
    assert len(data) >= 17


def test_models_one_config_by_path(run) -> None:
    path = REPO / "data/validation/models/mpt-7b.json"
    data = json.loads(run("models", str(path), "--json").stdout)
    assert [(m["id"], m["family"], m["num_params"]) for m in data] == [("mpt-7b", "mpt", 6_649_024_512)]


def test_models_unknown_id(run) -> None:
    r = run("models", "llama-2-70")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith("error: unknown model 'llama-2-70'; did you mean 'llama-2-70b'")
    assert len(r.stderr.strip().splitlines()) == 1


def test_help_texts(run) -> None:
    r = run("catalog", "--help")
    for option in ("--catalog", "--profile", "--prices", "--currency", "--json", "STARVERSE_CATALOG"):
        assert option in r.stdout
    assert "--json" in run("models", "--help").stdout
