"""Loading the catalog: bundled YAML, then the user's files, then the measured probe profile.

Order (later wins): ``accelerators.yaml`` + ``prices.yaml`` + ``currencies.yaml`` shipped with the package,
``$STARVERSE_CATALOG``, the ``path`` argument (``--catalog FILE``), then the probe profile. A user's file uses the
same format (keys ``accelerators:``, ``offers:``, ``currencies:``); an entry for a known accelerator updates
only the fields it gives, an offer with the same provider, accelerator and region replaces the known one.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError

from starverse.catalog.core import FLOAT_FIELDS, Accelerator, Catalog, Currency, Offer
from starverse.catalog.schema import AcceleratorEntry, CatalogFile, CurrencyEntry, OfferEntry
from starverse.config import FrozenModel, parse, read_text_file, read_yaml, validation_message
from starverse.errors import CatalogError, ConfigError

log = logging.getLogger(__name__)

DATA_DIR = Path(__file__).resolve().parent
BUNDLED_FILES = ("accelerators.yaml", "prices.yaml", "currencies.yaml")
CATALOG_ENV = "STARVERSE_CATALOG"
PROFILE_ENV = "STARVERSE_PROFILE"

_REQUIRED = (
    "name",
    "vendor",
    "stack",
    "bf16_tflops",
    "fp16_tflops",
    "fp32_tflops",
    "memory_gb",
    "memory_bw_gb_per_s",
    "intra_node_link",
    "intra_node_gb_per_s",
    "devices_per_node",
    "inter_node_gbps",
    "tdp_w",
)


_SOURCED = frozenset((*FLOAT_FIELDS, "devices_per_node", "intra_node_link", "matrix_unit"))
"""Fields that are figures (and so carry a source); name, vendor and stack are not."""


def default_profile_path() -> Path:
    """Where ``starverse probe`` writes its profile by default: ``~/.cache/starverse/profile.json``."""
    return Path.home() / ".cache" / "starverse" / "profile.json"


class ProfileFile(FrozenModel):
    """The probe profile JSON written by ``starverse probe``."""

    version: Literal[1]
    """Format version."""
    host: str
    """Host the figures were measured on."""
    measured_at: str
    """ISO time of the measurement."""
    accelerators: dict[str, dict[str, float]] = Field(default_factory=dict)
    """Accelerator id -> measured figures (any subset of the numeric accelerator fields)."""


@dataclass
class _Draft:
    """Mutable merge state while reading the layers of files."""

    accelerators: dict[str, dict[str, Any]]
    where: dict[str, str]  # accelerator id -> "file:line" of its first definition (for errors)
    offers: list[tuple[OfferEntry, str]]  # (entry, "file:line")
    currencies: dict[str, Currency]


def _line(node: yaml.Node | None, *path: str | int) -> int | None:
    """1-based line of the value at ``path`` in a composed YAML tree (or its nearest parent)."""
    line = None if node is None else node.start_mark.line + 1
    for key in path:
        if isinstance(node, yaml.MappingNode):
            # the key's own line: a mapping value starts on the line below its key
            pair = next(((k, v) for k, v in node.value if k.value == key), None)
            if pair is None:
                return line
            line, node = pair[0].start_mark.line + 1, pair[1]
        elif isinstance(node, yaml.SequenceNode) and isinstance(key, int) and key < len(node.value):
            node = node.value[key]
            line = node.start_mark.line + 1
        else:
            return line
    return line


def _at(source: str, node: yaml.Node | None, *path: str | int) -> str:
    line = _line(node, *path)
    return f"{source}:{line}" if line is not None else source


def _expand_sources(sources: Mapping[str, str], where: str) -> dict[str, str]:
    """``{"bf16_tflops, fp16_tflops": s}`` -> one entry per field; unknown field names are errors."""
    known = set(_REQUIRED) | _SOURCED
    out: dict[str, str] = {}
    for key, text in sources.items():
        for name in (k.strip() for k in key.split(",")):
            if name not in known:
                raise CatalogError(f"{where}: sources: unknown field '{name}'; sources name accelerator fields")
            out[name] = text
    return out


def _unknown_key_in_entry(err: ValidationError) -> tuple[tuple[str | int, ...], str] | None:
    """``accelerators.<id>.<typo>`` / ``currencies.<code>.<typo>``: did-you-mean against the entry's fields.

    (The generic formatter in starverse.config cannot see through the dict keyed by id.)
    """
    first = err.errors()[0]
    loc = tuple(first["loc"])
    owners: dict[str | int, type[FrozenModel]] = {"accelerators": AcceleratorEntry, "currencies": CurrencyEntry}
    if first["type"] != "extra_forbidden" or len(loc) != 3 or loc[0] not in owners:
        return None
    known = list(owners[loc[0]].model_fields)
    close = difflib.get_close_matches(str(loc[2]), known, n=1)
    hint = f"did you mean '{close[0]}'?" if close else f"known fields: {', '.join(known)}"
    return loc, f"{loc[0]}.{loc[1]}.{loc[2]}: unknown field; {hint}"


def _parse(data: Any, source: str, node: yaml.Node | None) -> CatalogFile:
    if isinstance(data, Mapping):
        try:
            return CatalogFile.model_validate(data)
        except ValidationError as e:
            special = _unknown_key_in_entry(e)
            if special is not None:
                raise CatalogError(f"{_at(source, node, *special[0])}: {special[1]}") from None
    return parse(CatalogFile, data, source, node)


def _merge_file(draft: _Draft, path: Path) -> None:
    try:
        data, node = read_yaml(path)
        cat = _parse(data, str(path), node)
    except CatalogError:
        raise
    except ConfigError as e:
        raise CatalogError(str(e)) from None
    src = str(path)
    for acc_id, entry in cat.accelerators.items():
        where = _at(src, node, "accelerators", acc_id)
        fields = entry.model_dump(exclude_unset=True, exclude={"sources"})
        sources = _expand_sources(entry.sources, where)
        current = draft.accelerators.setdefault(acc_id, {"sources": {}})
        draft.where.setdefault(acc_id, where)
        current.update(fields)
        # a figure given without a source inherits none: say where it was set instead
        for name in fields:
            if name in _SOURCED:
                current["sources"][name] = sources.get(name, f"set in {path.name}")
        current["sources"].update(sources)
    for i, offer in enumerate(cat.offers):
        where = _at(src, node, "offers", i)
        key = (offer.provider, offer.accelerator, offer.region)
        draft.offers = [(o, w) for o, w in draft.offers if (o.provider, o.accelerator, o.region) != key]
        draft.offers.append((offer, where))
    for code, cur in cat.currencies.items():
        draft.currencies[code.upper()] = _currency(code.upper(), cur)


def _currency(code: str, entry: CurrencyEntry) -> Currency:
    return Currency(code=code, usd_per_unit=entry.usd_per_unit, as_of=entry.as_of, source=entry.source)


def _build(draft: _Draft) -> Catalog:
    accs: dict[str, Accelerator] = {}
    for acc_id, fields in draft.accelerators.items():
        missing = [f for f in _REQUIRED if f not in fields]
        if missing:
            raise CatalogError(
                f"{draft.where[acc_id]}: accelerators.{acc_id}: new accelerator is missing "
                f"{', '.join(missing)} (a new id needs every field; check the spelling if you meant to "
                "override a known one, `starverse catalog` lists them)"
            )
        accs[acc_id] = Accelerator(id=acc_id, fp8_tflops=fields.get("fp8_tflops"), **{
            k: v for k, v in fields.items() if k != "fp8_tflops"
        })
    offers: list[Offer] = []
    for entry, where in draft.offers:
        if entry.accelerator not in accs:
            from starverse.catalog.core import unknown_accelerator_message

            raise CatalogError(f"{where}: offers: {unknown_accelerator_message(entry.accelerator, list(accs))}")
        if entry.currency not in draft.currencies:
            from starverse.catalog.core import unknown_currency_message

            raise CatalogError(
                f"{where}: offers: {unknown_currency_message(entry.currency, list(draft.currencies))}"
            )
        if entry.spot_price_per_hour is not None and entry.spot_price_per_hour > entry.price_per_hour:
            raise CatalogError(
                f"{where}: offers: spot_price_per_hour ({entry.spot_price_per_hour}) is above "
                f"price_per_hour ({entry.price_per_hour}); check the two prices"
            )
        offers.append(Offer(**entry.model_dump()))
    return Catalog(accelerators=accs, offers=tuple(offers), currencies=dict(draft.currencies))


@functools.lru_cache(maxsize=1)
def _bundled_draft() -> _Draft:
    """Parse the bundled files once per process (they never change while it runs); callers copy it."""
    draft = _Draft({}, {}, [], {})
    for name in BUNDLED_FILES:
        _merge_file(draft, DATA_DIR / name)
    return draft


def _fresh_draft() -> _Draft:
    return copy.deepcopy(_bundled_draft())


def _load_profile(path: Path, catalog: Catalog) -> Catalog:
    if not path.exists() and not path.is_symlink():
        raise CatalogError(f"{path}: probe profile not found; run `starverse probe` to write one")
    try:  # a folder, a FIFO (read forever), a binary or huge file: one line, as for any file the user names
        text = read_text_file(path, "a probe profile JSON (`starverse probe` writes one)")
    except ConfigError as e:
        raise CatalogError(str(e)) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise CatalogError(
            f"{path}:{e.lineno}: malformed probe profile JSON: {e.msg}; rerun `starverse probe`"
        ) from None
    except (ValueError, RecursionError) as e:  # a number beyond 4300 digits; nesting deeper than the stack
        raise CatalogError(f"{path}: malformed probe profile JSON: {str(e).split(';')[0]}; rerun `starverse probe`"
                           ) from None
    try:
        profile = parse(ProfileFile, data, str(path))
    except ConfigError as e:
        raise CatalogError(f"{e}; rerun `starverse probe`") from None
    note = f"measured by starverse probe on {profile.host} at {profile.measured_at}"
    overrides: dict[str, dict[str, Any]] = {}
    added: dict[str, Accelerator] = {}
    for acc_id, fields in profile.accelerators.items():
        unknown = sorted(set(fields) - set(FLOAT_FIELDS) - {"devices_per_node"})
        if unknown:
            raise CatalogError(
                f"{path}: accelerators.{acc_id}.{unknown[0]}: unknown figure; a profile may hold "
                f"{', '.join(FLOAT_FIELDS)}; rerun `starverse probe`"
            )
        # a failed measurement (0, e.g. no sysconf) must not replace a datasheet figure or brick the catalog
        bad = sorted(k for k, v in fields.items() if not v > 0)
        if bad:
            log.warning("%s: %s: ignoring non-positive measured %s", path, acc_id, ", ".join(bad))
        good = {k: v for k, v in fields.items() if k not in bad}
        try:  # the catalog file's bounds: a profile of 1e300 TFLOP/s is as wrong as a catalog of it
            AcceleratorEntry.model_validate(good)
        except ValidationError as e:
            _, text = validation_message(AcceleratorEntry, e)
            raise CatalogError(f"{path}: accelerators.{acc_id}.{text}; rerun `starverse probe`") from None
        if acc_id in catalog.accelerators:
            overrides[acc_id] = {**good, "sources": dict.fromkeys(good, note)}
        else:
            added[acc_id] = _measured_accelerator(acc_id, good, note, path)
    catalog = catalog._with_overrides(overrides, note)
    if added:
        catalog = dataclasses.replace(catalog, accelerators={**catalog.accelerators, **added})
    return catalog


# id prefix that `starverse probe` gives a device it cannot name -> (stack, vendor, link, intra GB/s)
_PROBED_KINDS = {
    "cuda-": ("cuda", "unknown (CUDA device)", "pcie", 16.0),
    "rocm-": ("rocm", "unknown (ROCm device)", "pcie", 16.0),
    "cpu-": ("cpu", "generic", "none", 5.0),
}


def _measured_accelerator(acc_id: str, figures: Mapping[str, float], note: str, path: Path) -> Accelerator:
    """An accelerator known only from the probe profile (a GPU model the catalog does not list).

    Measured figures are used as they are; what a probe cannot measure gets a conservative default whose
    source says so. Describing the device in a catalog file (--catalog) replaces the defaults.
    """
    kind = next((v for prefix, v in _PROBED_KINDS.items() if acc_id.startswith(prefix)), None)
    peak = figures.get("bf16_tflops") or figures.get("fp32_tflops")
    if kind is None or peak is None or "memory_gb" not in figures:
        raise CatalogError(
            f"{path}: accelerators.{acc_id}: not in the catalog, and the profile alone cannot describe it "
            "(needs a cuda-/rocm-/cpu- id with bf16_tflops or fp32_tflops and memory_gb); describe it in a "
            "catalog file (--catalog FILE) or rerun `starverse probe`"
        )
    stack, vendor, link, intra = kind
    assumed = "assumed default: not measured by the probe and not in the catalog (describe it with --catalog)"
    def fig(name: str, default: float) -> float:
        return float(figures.get(name, default))

    sources = {k: (note if k in figures else assumed) for k in (*FLOAT_FIELDS, "devices_per_node")}
    sources["intra_node_link"] = assumed
    return Accelerator(
        id=acc_id,
        name=f"{acc_id} (measured by starverse probe)",
        vendor=vendor,
        stack=stack,
        bf16_tflops=float(peak),
        fp16_tflops=fig("fp16_tflops", peak),
        fp32_tflops=fig("fp32_tflops", peak),
        fp8_tflops=figures.get("fp8_tflops"),
        memory_gb=float(figures["memory_gb"]),
        memory_bw_gb_per_s=fig("memory_bw_gb_per_s", 100.0),
        intra_node_link=link,
        intra_node_gb_per_s=fig("intra_node_gb_per_s", intra),
        devices_per_node=int(figures.get("devices_per_node", 1)),
        inter_node_gbps=fig("inter_node_gbps", 10.0),
        tdp_w=fig("tdp_w", 300.0),
        sources=sources,
    )


def _profile_path(profile: str | Path | None) -> Path | None:
    if profile is not None:
        return Path(profile) if str(profile) else None
    env = os.environ.get(PROFILE_ENV)
    if env is not None:
        # STARVERSE_PROFILE="" turns the default profile off (reproducible runs, tests)
        return Path(env) if env else None
    default = default_profile_path()
    return default if default.is_file() else None


def load_catalog(path: str | Path | None = None, profile: str | Path | None = None) -> Catalog:
    """The bundled catalog, extended by ``$STARVERSE_CATALOG`` then ``path``, then the probe profile.

    ``profile``: a probe profile JSON; None means ``$STARVERSE_PROFILE`` if set (empty = none), else
    ``~/.cache/starverse/profile.json`` if it exists; ``""`` means none. Raises CatalogError with
    ``file:line: field: message`` for malformed files.
    """
    files, prof, key = _inputs(path, profile)
    # the catalog is immutable: planners call this in loops, so reuse it while no input file changed
    cached = _cache.get(key)
    if cached is not None:
        return cached
    draft = _fresh_draft()
    for extra in files:
        _merge_file(draft, extra)
    catalog = _build(draft)
    if prof is not None:
        catalog = _load_profile(prof, catalog)
        log.debug("catalog: applied probe profile %s", prof)
    if len(_cache) > 16:
        _cache.clear()
    _cache[key] = catalog
    return catalog


_cache: dict[tuple[tuple[str, int, int], ...], Catalog] = {}


def _inputs(path: str | Path | None, profile: str | Path | None
            ) -> tuple[list[Path], Path | None, tuple[tuple[str, int, int], ...]]:
    """The extra catalog files, the profile, and their stamps (what :func:`load_catalog` is a function of)."""
    env = os.environ.get(CATALOG_ENV)
    files = [Path(p) for p in (env, path) if p]
    prof = _profile_path(profile)
    stamps = [(str(f), *_stamp(f)) for f in files]
    stamps.append((f"profile:{prof}", *(_stamp(prof) if prof else (0, 0))))
    return files, prof, tuple(stamps)


def catalog_version(path: str | Path | None = None, profile: str | Path | None = None) -> str:
    """Names the catalog :func:`load_catalog` would return now (its input files and their stamps): equal
    versions, equal catalogs. A cache of planner results keys on it."""
    return repr(_inputs(path, profile)[2])


def _stamp(path: Path) -> tuple[int, int]:
    """(mtime in ns, size) of a file: a changed file is read again."""
    try:
        st = path.stat()
    except OSError:
        return (-1, -1)  # missing: loading it raises, so nothing is cached under this key
    return (st.st_mtime_ns, st.st_size)


def bundled_catalog() -> Catalog:
    """Only the files shipped with the package (no user file, no profile): for tests and documentation."""
    return _build(_fresh_draft())
