"""Loading YAML files into validated, frozen pydantic objects, with one-line errors.

Every file a user writes (plan, pool, job, catalog) goes through :func:`load_file`. Errors name the file,
the line, the field path and the fix, for example::

    pool.yaml:7: offers[2].price_per_hour: must be greater than 0 (got -1)
    plan.yaml:3: train.globl_batch: unknown field; did you mean 'global_batch'?
"""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from starverse.errors import ConfigError

M = TypeVar("M", bound=BaseModel)


class FrozenModel(BaseModel):
    """Base for every file-backed object: unknown keys are errors, values are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def read_yaml(path: str | Path) -> tuple[Any, yaml.Node | None]:
    """Parse a YAML file; return the data and its node tree (for line numbers in later errors)."""
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise ConfigError(f"{p}: file not found") from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as e:
        raise ConfigError(f"{p}: cannot read ({e.__class__.__name__})") from None
    try:
        # Parse once: compose the node tree (kept for line numbers), then construct the data from it.
        loader = yaml.CSafeLoader(text) if hasattr(yaml, "CSafeLoader") else yaml.SafeLoader(text)
        try:
            node = loader.get_single_node()
            data = loader.construct_document(node) if node is not None else None
        finally:
            loader.dispose()
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{p}{where}: malformed YAML: {problem}") from None
    return data, node


def _line_of(node: yaml.Node | None, loc: Sequence[int | str]) -> int | None:
    """1-based line of the value at ``loc`` in a composed YAML tree (or of its closest parent)."""
    line = None if node is None else node.start_mark.line + 1
    for key in loc:
        if isinstance(node, yaml.MappingNode):
            nxt = next((v for k, v in node.value if k.value == key), None)
            if nxt is None:
                # unknown key: point at the key itself
                knode = next((k for k, _ in node.value if k.value == key), None)
                return knode.start_mark.line + 1 if knode is not None else line
            node = nxt
        elif isinstance(node, yaml.SequenceNode) and isinstance(key, int) and key < len(node.value):
            node = node.value[key]
        else:
            return line
        line = node.start_mark.line + 1
    return line


def format_loc(loc: Sequence[int | str]) -> str:
    """``("offers", 2, "price")`` -> ``offers[2].price``."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def _model_at(cls: type[BaseModel], loc: Sequence[int | str]) -> type[BaseModel] | None:
    """The pydantic model class that owns the last key of ``loc`` (for did-you-mean)."""
    current: Any = cls
    skip_next_key = False  # the next str key is a dict key (``dict[str, Model]``), not a field name
    for key in loc[:-1]:
        if isinstance(key, int):
            continue
        if skip_next_key:
            skip_next_key = False
            continue
        if not (isinstance(current, type) and issubclass(current, BaseModel)):
            return None
        field = current.model_fields.get(key)
        if field is None:
            return None
        skip_next_key = _is_dict(field.annotation)
        current = _unwrap(field.annotation)
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None


def _is_dict(tp: Any) -> bool:
    """Whether ``tp`` is ``dict[...]`` (possibly inside ``X | None``)."""
    if typing.get_origin(tp) is dict:
        return True
    return any(_is_dict(a) for a in typing.get_args(tp)) if typing.get_origin(tp) is types.UnionType else False


def _unwrap(tp: Any) -> Any:
    """Find the model class inside ``list[X]``, ``X | None``, ``dict[str, X]``..."""
    origin = typing.get_origin(tp)
    if origin is None:
        return tp
    for arg in reversed(typing.get_args(tp)):
        inner = _unwrap(arg)
        if isinstance(inner, type) and issubclass(inner, BaseModel):
            return inner
    return tp if origin is not types.UnionType else None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def validation_message(cls: type[BaseModel], err: ValidationError) -> tuple[tuple[int | str, ...], str]:
    """Turn the first pydantic error into ``(loc, "field: message")`` with a did-you-mean."""
    errors = err.errors()
    # A misspelt key shows up as both "unknown" and "missing": the unknown key is the useful message.
    first = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
    loc = tuple(p for p in first["loc"] if not (isinstance(p, str) and p.startswith("function-")))
    kind = first["type"]
    field = format_loc(loc)
    if kind == "extra_forbidden":
        owner = _model_at(cls, loc)
        known = list(owner.model_fields) if owner is not None else []
        close = difflib.get_close_matches(str(loc[-1]), known, n=1)
        hint = f"did you mean '{close[0]}'?" if close else f"known fields: {', '.join(known)}"
        return loc, f"{field}: unknown field; {hint}"
    if kind == "missing":
        return loc, f"{field}: required field is missing"
    msg = first["msg"]
    msg = msg.replace("Input should be ", "must be ").replace("Value error, ", "")
    got = f" (got {_short(first['input'])})" if "input" in first and kind != "value_error" else ""
    return loc, f"{field}: {msg}{got}"


def parse(cls: type[M], data: Any, source: str | Path, node: yaml.Node | None = None) -> M:
    """Validate ``data`` as ``cls``; any error becomes one ``ConfigError`` line naming file and field."""
    if data is None:
        raise ConfigError(f"{source}: file is empty; expected a mapping of {cls.__name__} fields")
    if not isinstance(data, Mapping):
        raise ConfigError(f"{source}: expected a mapping at top level, got {type(data).__name__}")
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        loc, text = validation_message(cls, e)
        line = _line_of(node, loc)
        where = f"{source}:{line}" if line is not None else str(source)
        raise ConfigError(f"{where}: {text}") from None


def load_file(cls: type[M], path: str | Path) -> M:
    """Read a YAML file and validate it as ``cls`` (see :func:`parse`)."""
    data, node = read_yaml(path)
    return parse(cls, data, str(path), node)


def did_you_mean(name: str, known: Sequence[str]) -> str:
    """`` did you mean 'x'?`` or an empty string."""
    close = difflib.get_close_matches(name, list(known), n=3, cutoff=0.5)
    return f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
