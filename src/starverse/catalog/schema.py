"""The catalog file format (YAML): what the bundled files and a user's ``--catalog FILE`` contain.

Every field of an accelerator entry is optional here so that a user's file can override a few figures of a
bundled accelerator; a *new* accelerator must give all required fields (checked after merging, by the loader).
Every figure is finite, more than 0 and below a physical bound (the ``MAX_*`` constants of
:mod:`starverse.config`, named in the error): ``bf16_tflops: 1e300`` would make every step free.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from starverse.config import (
    MAX_COUNT,
    MAX_GB_PER_S,
    MAX_GBPS,
    MAX_MEMORY_BW_GB_PER_S,
    MAX_MEMORY_GB,
    MAX_MONEY,
    MAX_POWER_W,
    MAX_SECONDS,
    MAX_TFLOPS,
    MAX_USD_PER_UNIT,
    MIN_USD_PER_UNIT,
    FrozenModel,
)

Stack = Literal["cuda", "rocm", "xla", "npu", "mlu", "cpu"]
Link = Literal["nvlink", "pcie", "ici", "hccs", "infinity-fabric", "mlu-link", "none"]


class AcceleratorEntry(FrozenModel):
    """One accelerator (or a partial override of a known one)."""

    name: str | None = None
    """Product name."""
    vendor: str | None = None
    """Maker (nvidia, amd, google, huawei, cambricon, generic)."""
    stack: Stack | None = None
    """Software stack: cuda | rocm | xla | npu | mlu | cpu."""
    bf16_tflops: float | None = Field(default=None, gt=0, le=MAX_TFLOPS)
    """Dense BF16 peak, TFLOP/s (never the sparse figure)."""
    fp16_tflops: float | None = Field(default=None, gt=0, le=MAX_TFLOPS)
    """Dense FP16 peak with FP32 accumulate, TFLOP/s."""
    fp32_tflops: float | None = Field(default=None, gt=0, le=MAX_TFLOPS)
    """FP32 peak (no TF32), TFLOP/s."""
    fp8_tflops: float | None = Field(default=None, gt=0, le=MAX_TFLOPS)
    """Dense FP8 peak, TFLOP/s; omit where the device has no FP8."""
    memory_gb: float | None = Field(default=None, gt=0, le=MAX_MEMORY_GB)
    """Device memory, GB."""
    memory_bw_gb_per_s: float | None = Field(default=None, gt=0, le=MAX_MEMORY_BW_GB_PER_S)
    """Device memory bandwidth, GB/s."""
    intra_node_link: Link | None = None
    """Kind of intra-node link."""
    intra_node_gb_per_s: float | None = Field(default=None, gt=0, le=MAX_GB_PER_S)
    """Intra-node bandwidth per device, one direction, GB/s."""
    devices_per_node: int | None = Field(default=None, gt=0, le=MAX_COUNT)
    """Default devices per node."""
    inter_node_gbps: float | None = Field(default=None, gt=0, le=MAX_GBPS)
    """Default NIC bandwidth per node, Gbit/s."""
    tdp_w: float | None = Field(default=None, gt=0, le=MAX_POWER_W)
    """Board power, W."""
    host_memory_gb: float | None = Field(default=None, gt=0, le=MAX_MEMORY_GB)
    """RAM per node of the default instance type, GB (needed by CPU offload)."""
    matrix_unit: int | None = Field(default=None, gt=0, le=4096)
    """Edge of the systolic matrix unit, elements (TPU MXU: 128; v6e: 256): its matmuls are a roofline with
    axes under it padded up; omit for GPUs (their tile and wave term)."""
    sources: dict[str, str] = Field(default_factory=dict)
    """Field -> source of the figure. A key may name several fields separated by commas."""


class OfferEntry(FrozenModel):
    """A rentable price for one accelerator, per device-hour."""

    provider: str
    """Who rents it."""
    accelerator: str
    """Catalog id."""
    price_per_hour: float = Field(gt=0, le=MAX_MONEY)
    """On-demand price per device-hour."""
    spot_price_per_hour: float | None = Field(default=None, gt=0, le=MAX_MONEY)
    """Spot price per device-hour (optional)."""
    currency: str = "USD"
    """ISO 4217 code; must be in the currency table."""
    billing_granularity_s: int = Field(default=1, gt=0, le=MAX_SECONDS)
    """Billing increment, seconds."""
    as_of: str
    """Date of the price."""
    source: str
    """Where it comes from, with any arithmetic."""
    region: str | None = None
    """Region, if the price depends on it."""

    @field_validator("currency")
    @classmethod
    def _upper(cls, v: str) -> str:
        return v.upper()


class CurrencyEntry(FrozenModel):
    """An exchange rate."""

    usd_per_unit: float = Field(ge=MIN_USD_PER_UNIT, le=MAX_USD_PER_UNIT)
    """US dollars for one unit."""
    as_of: str
    """Date of the rate."""
    source: str
    """Where the rate comes from."""


class CatalogFile(FrozenModel):
    """A catalog YAML file: any of the three sections."""

    accelerators: dict[str, AcceleratorEntry] = Field(default_factory=dict)
    """Accelerator id -> entry (new, or a partial override of a known id)."""
    offers: list[OfferEntry] = Field(default_factory=list)
    """Offers; one with the same provider, accelerator and region as a known offer replaces it."""
    currencies: dict[str, CurrencyEntry] = Field(default_factory=dict)
    """ISO code -> rate against USD."""
