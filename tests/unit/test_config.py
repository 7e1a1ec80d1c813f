"""One-line errors for files users write: file, line, field path, did-you-mean."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import Field

from starverse.config import FrozenModel, format_loc, load_file
from starverse.errors import ConfigError


class Offer(FrozenModel):
    accelerator: str
    count: int = Field(gt=0)
    price_per_hour: float = Field(gt=0)


class Pool(FrozenModel):
    currency: str = "USD"
    offers: list[Offer]


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "pool.yaml"
    p.write_text(text)
    return p


def test_valid_file_loads(tmp_path: Path) -> None:
    p = _write(tmp_path, "offers:\n  - {accelerator: rtx-4090, count: 8, price_per_hour: 0.3}\n")
    pool = load_file(Pool, p)
    assert pool.offers[0].count == 8 and pool.currency == "USD"


def test_negative_price_names_file_line_and_field(tmp_path: Path) -> None:
    p = _write(
        tmp_path,
        "currency: USD\noffers:\n  - accelerator: a\n    count: 1\n    price_per_hour: 1\n"
        "  - accelerator: b\n    count: 2\n    price_per_hour: -1\n",
    )
    with pytest.raises(ConfigError) as e:
        load_file(Pool, p)
    assert str(e.value) == f"{p}:8: offers[1].price_per_hour: must be greater than 0 (got -1). To fix: give a number more than 0"


def test_unknown_key_did_you_mean(tmp_path: Path) -> None:
    p = _write(tmp_path, "offers:\n  - {accelerator: a, count: 1, price_per_hr: 2}\n")
    with pytest.raises(ConfigError) as e:
        load_file(Pool, p)
    assert "offers[0].price_per_hr: unknown field; did you mean 'price_per_hour'?" in str(e.value)
    assert str(e.value).startswith(f"{p}:2:")


def test_unknown_top_level_key_lists_fields_when_nothing_close(tmp_path: Path) -> None:
    p = _write(tmp_path, "offers: []\nzzz: 1\n")
    with pytest.raises(ConfigError) as e:
        load_file(Pool, p)
    assert str(e.value) == f"{p}:2: zzz: unknown field; known fields: currency, offers"


def test_missing_field(tmp_path: Path) -> None:
    p = _write(tmp_path, "currency: USD\n")
    with pytest.raises(ConfigError, match=r"offers: required field is missing"):
        load_file(Pool, p)


def test_malformed_yaml_reports_line(tmp_path: Path) -> None:
    p = _write(tmp_path, "offers:\n  - {accelerator: a, count: 1\n  bad: [\n")
    with pytest.raises(ConfigError) as e:
        load_file(Pool, p)
    assert str(e.value).startswith(f"{p}:") and "malformed YAML" in str(e.value)
    line = int(str(e.value).split(":")[1])
    assert line >= 2


def test_empty_and_non_mapping_files(tmp_path: Path) -> None:
    p = _write(tmp_path, "")
    with pytest.raises(ConfigError, match="file is empty"):
        load_file(Pool, p)
    p.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="expected a mapping at top level, got list"):
        load_file(Pool, p)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="file not found"):
        load_file(Pool, tmp_path / "nope.yaml")


def test_format_loc() -> None:
    assert format_loc(("offers", 2, "price")) == "offers[2].price"
    assert format_loc(()) == "(top level)"


class Spec(FrozenModel):
    memory_gb: float


class Cat(FrozenModel):
    accelerators: dict[str, Spec]


def test_did_you_mean_inside_dict_keyed_by_id(tmp_path: Path) -> None:
    p = tmp_path / "cat.yaml"
    p.write_text("accelerators:\n  a100:\n    memory_gbs: 80\n")
    with pytest.raises(ConfigError) as e:
        load_file(Cat, p)
    assert str(e.value) == f"{p}:3: accelerators.a100.memory_gbs: unknown field; did you mean 'memory_gb'?"
