"""Loading YAML files into validated, frozen pydantic objects, with one-line errors.

Every file a user writes (plan, pool, job, catalog) goes through :func:`load_file`. Errors name the file,
the line, the field path and the fix, for example::

    pool.yaml:7: offers[2].price_per_hour: must be greater than 0 (got -1)
    plan.yaml:3: train.globl_batch: unknown field; did you mean 'global_batch'?

A file is checked before its values are built: a key given twice in one mapping, a document that expands
(aliases included) to more than :data:`MAX_YAML_VALUES` values, and a recursive alias are refused with their
line. Every model is strict about numbers: no ``.inf``/``.nan`` (nor ``1e400``, which YAML reads as infinity),
and sizes that the planner, the cost model or the runtime multiply or allocate carry an upper bound (the
``MAX_*`` constants below), named in the message when it is broken.
"""

from __future__ import annotations

import difflib
import errno
import reprlib
import stat
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, TypeVar

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, ValidationError, ValidationInfo, field_validator

from starverse.errors import ConfigError

M = TypeVar("M", bound=BaseModel)

MAX_YAML_VALUES = 200_000
"""Most values (scalars, lists and mappings, aliases expanded) one file may hold: a YAML alias bomb is refused
before anything walks it."""
MAX_SEQ_LEN = 1 << 24
"""Longest sequence, tokens (16,777,216)."""
MAX_BATCH = 1 << 16
"""Most sequences in one optimizer step or micro-batch (65,536; published runs use a few thousand). The
planner tabulates every batch split, so its memory grows with this bound."""
MAX_COUNT = 1 << 20
"""Most devices, replicas, layers, ranks, degrees or adapter ranks a file may give (1,048,576)."""
MAX_STEPS = 10**12
"""Most optimizer steps of a job."""
MAX_TOKENS = 1e18
"""Most tokens of a job (a million times the largest published training run)."""
MAX_SECONDS = 10 * 366 * 86400
"""Longest duration a file may give in seconds (ten years): billing units, intervals, grace periods."""
MAX_MONEY = 10**12
"""Largest amount of money (budget, price) in any currency; the ledger stores micro-units as 64-bit integers."""
MAX_SEED = 2**63 - 1
"""Largest random seed (torch seeds are 64-bit)."""
MAX_FILE_BYTES = 64 << 20
"""Largest file a command reads as text (64 MiB): a job, pool, plan or catalog file is a few kilobytes, the bundled
catalog a few hundred; ``/dev/zero`` or a multi-gigabyte log named by mistake would be read until memory ran out."""
MAX_PATH_PART = 255
"""Longest file-name component a path may have (NAME_MAX of Linux and macOS)."""
MAX_PATH = 4096
"""Longest path (PATH_MAX of Linux)."""
MAX_GBPS = 100_000.0
"""Fastest link a file may give, Gbit/s (100 Tbit/s): above every link a node has today, the 14.4 Tbit/s of one
GPU's NVLink 5 (1.8 TB/s, NVIDIA GB200 NVL72 datasheet) and the 6.4 Tbit/s of eight 800 Gbit/s NICs (NVIDIA
ConnectX-8 SuperNIC). ``1e300`` would make every transfer free and every plan look network-bound by nothing."""
MAX_GB_PER_S = MAX_GBPS / 8
"""The same bound in GB/s (12,500 GB/s), for bus bandwidths given in bytes."""
MAX_INTERRUPTIONS_PER_HOUR = 3600.0
"""Most losses per device-hour a file may give (one a second): a device lost more often than that completes no
training step at all, and the Young/Daly interval it implies rounds to nothing."""
MAX_MEMORY_GB = 100_000.0
"""Most memory a file may give one device or node, GB (100 TB): above the 32 TiB of RAM of the largest cloud
node (AWS EC2 u7in-32tb.224xlarge) and far above any device's memory (288 GB HBM3E: NVIDIA B300, AMD Instinct
MI355X datasheets). ``1e300`` would make every plan fit."""
MAX_TFLOPS = 1_000_000.0
"""Highest peak a catalog may give one device, TFLOP/s (1 EFLOP/s): far above the densest device's dense FP8
(4.5 PFLOP/s, NVIDIA B200 datasheet) and the 125 PFLOP/s Cerebras quotes for a whole WSE-3 wafer. ``1e300``
would make every step take no time."""
MAX_MEMORY_BW_GB_PER_S = 100_000.0
"""Fastest device-memory bandwidth a catalog may give, GB/s (100 TB/s): over ten times the 8 TB/s of HBM3E
(NVIDIA B200, AMD Instinct MI355X datasheets)."""
MAX_POWER_W = 100_000.0
"""Highest board power a catalog may give one device, W (100 kW): above the 23 kW of a Cerebras CS-3 system and
a hundred times a B200's 1 kW."""
MIN_USD_PER_UNIT = 1e-9
"""Lowest exchange rate a catalog may give, US dollars per unit: below every currency in use (the cheapest trade
at a few millionths of a dollar); prices are divided by it, so ``1e-300`` would turn every price into a number no ledger holds."""
MAX_USD_PER_UNIT = 1e6
"""Highest exchange rate a catalog may give, US dollars per unit (the dearest currency in use is near 3.3 USD)."""


def _is_number_type(tp: Any) -> bool:
    """Whether a field of type ``tp`` holds only numbers (``int``, ``float``, optionally ``None``): then
    ``true``/``false`` is a mistake, which pydantic would silently read as 1/0."""
    origin = typing.get_origin(tp)
    if origin is Annotated:
        return _is_number_type(typing.get_args(tp)[0])
    if origin in (types.UnionType, typing.Union):
        members = [a for a in typing.get_args(tp) if a is not type(None)]
        return bool(members) and all(_is_number_type(a) for a in members)
    return tp in (int, float)


class LocatedError(ValueError):
    """A validator's error at ``loc`` below where pydantic reports it (a list element, a mapping's value or key;
    for a model validator, a field of the model): :func:`validation_message` adds ``loc`` to pydantic's, so the
    error names that field and its line."""

    def __init__(self, message: str, loc: tuple[int | str, ...]):
        super().__init__(message)
        self.loc = loc


class BoolNumberError(LocatedError):
    """A boolean where a number is meant, at ``loc`` inside the field's value."""


def _bool_in(value: Any, tp: Any) -> tuple[tuple[int | str, ...], bool] | None:
    """Where in ``value`` a boolean stands for a number of type ``tp`` (``int``, ``list[int]``,
    ``dict[str, float]``, ``dict[int, float]``, nested, optionally ``| None``): the path to it (``()``: ``value``
    itself) and the boolean; None when there is none."""
    if value.__class__ is bool:
        return ((), value) if _is_number_type(tp) else None
    origin = typing.get_origin(tp)
    if origin is Annotated:
        return _bool_in(value, typing.get_args(tp)[0])
    if origin in (types.UnionType, typing.Union):
        members = [a for a in typing.get_args(tp) if a is not type(None)]
        return _bool_in(value, members[0]) if len(members) == 1 else None
    args = typing.get_args(tp)
    if origin in (list, tuple, set, frozenset) and args and isinstance(value, list | tuple):
        for i, item in enumerate(value):
            found = _bool_in(item, args[0])
            if found is not None:
                return (i, *found[0]), found[1]
    if origin is dict and len(args) == 2 and isinstance(value, Mapping):
        for k, v in value.items():
            if k.__class__ is bool and _is_number_type(args[0]):
                return (str(k).lower(),), k
            found = _bool_in(v, args[1])
            if found is not None:
                return (k if isinstance(k, str | int) else str(k), *found[0]), found[1]
    return None


class FrozenModel(BaseModel):
    """Base for every file-backed object: unknown keys are errors, values are immutable, numbers finite, and a
    number is never a boolean (pydantic would read ``tp: true`` as 1)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        field = cls.model_fields.get(info.field_name) if info.field_name is not None else None
        if field is not None and value.__class__ in (bool, list, dict):
            found = _bool_in(value, field.annotation)
            if found is not None:
                raise BoolNumberError(f"must be a number, not a boolean (got {str(found[1]).lower()}). To fix: give "
                                      "a number", found[0])
        return value


def check_path_text(value: str, what: str = "name or path") -> str:
    """``value`` if it can name a file (no NUL byte, each part at most 255 characters, 4096 in all), else
    ValueError saying which limit it breaks (a longer name is refused by the OS with a traceback later)."""
    if "\x00" in value:
        raise ValueError(f"a {what} cannot contain a NUL byte")
    if len(value) > MAX_PATH:
        raise ValueError(f"a {what} has at most {MAX_PATH} characters (got {len(value)})")
    longest = max((len(part.encode()) for part in value.split("/")), default=0)
    if longest > MAX_PATH_PART:
        raise ValueError(f"a {what} has at most {MAX_PATH_PART} bytes between slashes (got {longest})")
    return value


PathText = Annotated[str, AfterValidator(check_path_text)]
"""A string that names a file or a model (model ids are looked up as paths too)."""


def read_yaml(path: str | Path) -> tuple[Any, yaml.Node | None]:
    """Parse a YAML file; return the data and its node tree (for line numbers in later errors)."""
    return parse_yaml_text(read_text_file(path, "a YAML file"), Path(path))


def read_text_file(path: str | Path, what: str, max_bytes: int = MAX_FILE_BYTES) -> str:
    """The UTF-8 text of the regular file ``path`` (``what`` it should be, for the fix), at most ``max_bytes``;
    ConfigError naming the file, why it cannot be read and the fix otherwise (a folder, a symlink loop, a
    device or FIFO that would be read forever or block, a binary file, a file the user may not read)."""
    p = Path(path)
    fix = f"To fix: give the path of {what}"
    try:
        st = p.stat()
        if stat.S_ISDIR(st.st_mode):
            raise ConfigError(f"{p}: cannot read (IsADirectoryError: a folder, not a file). {fix}")
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{p}: cannot read (not a regular file: a device, FIFO or socket). {fix}")
        if st.st_size > max_bytes:
            raise ConfigError(f"{p}: cannot read (FileTooLarge: {st.st_size:,} bytes, at most {max_bytes:,}). {fix}")
        with p.open("rb") as fh:
            data = fh.read(max_bytes + 1)
    except FileNotFoundError:
        raise ConfigError(f"{p}: file not found") from None
    except OSError as e:  # permission denied, a symlink loop, an I/O error
        if e.errno == errno.ENAMETOOLONG:  # the CLI says so in one line, with the name cut short
            raise
        raise ConfigError(f"{p}: cannot read ({e.__class__.__name__}: {e.strerror or e}). {fix}") from None
    if len(data) > max_bytes:  # grew while read
        raise ConfigError(f"{p}: cannot read (FileTooLarge: more than {max_bytes:,} bytes). {fix}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p}: cannot read (UnicodeDecodeError: byte {data[e.start]:#04x} at offset {e.start} is "
                          f"not UTF-8: a binary file?). {fix}") from None


def parse_yaml_text(text: str, source: str | Path) -> tuple[Any, yaml.Node | None]:
    """Parse YAML ``text`` (a file's, or a request body's: ``source`` names it in errors) with the checks of
    :func:`check_tree`; return the data and its node tree."""
    try:
        # Parse once: compose the node tree (kept for line numbers), then construct the data from it.
        loader = yaml.CSafeLoader(text) if hasattr(yaml, "CSafeLoader") else yaml.SafeLoader(text)
        try:
            node = loader.get_single_node()
            if node is not None:
                check_tree(node, source)
            data = loader.construct_document(node) if node is not None else None
        finally:
            loader.dispose()
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        context = getattr(e, "context", None)
        problem = f"{context} {problem}" if context and not context.startswith("while") else problem
        raise ConfigError(f"{source}{where}: malformed YAML: {problem}") from None
    except ValueError as e:  # a number of more than 4300 digits (Python's int conversion limit)
        raise ConfigError(f"{source}: malformed YAML: {str(e).split(';')[0]}") from None
    except RecursionError:
        raise ConfigError(f"{source}: malformed YAML: nested too deeply (thousands of [ or {{). To fix: a job, "
                          "pool or plan file nests a few levels") from None
    return data, node


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [n for kv in node.value for n in kv]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def check_tree(root: yaml.Node, source: str | Path) -> None:
    """Refuse a duplicate key, a recursive alias, or more than :data:`MAX_YAML_VALUES` values once aliases are
    expanded; one pass over the distinct nodes (an alias is a shared node, counted once per use, never walked
    twice), so a billion-laughs file is refused in microseconds."""
    sizes: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[yaml.Node, tuple[int | str, ...], bool]] = [(root, (), False)]
    while stack:
        node, loc, done = stack.pop()
        nid = id(node)
        if done:
            on_path.discard(nid)
            sizes[nid] = 1 + sum(sizes[id(c)] for c in _children(node))
            if sizes[nid] > MAX_YAML_VALUES:
                raise ConfigError(
                    f"{source}:{node.start_mark.line + 1}: {format_loc(loc)}: expands to more than "
                    f"{MAX_YAML_VALUES:,} values (aliases expanded); a job, pool or plan file is far smaller. To "
                    "fix: remove the repeated aliases (*name)")
            continue
        if nid in sizes:
            continue
        if nid in on_path:
            raise ConfigError(f"{source}:{node.start_mark.line + 1}: {format_loc(loc)}: recursive alias (a value "
                              "that contains itself). To fix: remove the alias (*name) inside its own anchor")
        on_path.add(nid)
        stack.append((node, loc, True))
        if isinstance(node, yaml.MappingNode):
            first: dict[tuple[str, str], yaml.Node] = {}
            for k, v in node.value:
                if isinstance(k, yaml.ScalarNode) and k.tag != "tag:yaml.org,2002:merge":
                    prev = first.setdefault((k.tag, k.value), k)
                    if prev is not k:
                        raise ConfigError(
                            f"{source}:{k.start_mark.line + 1}: {format_loc((*loc, k.value))}: duplicate key (first "
                            f"given at line {prev.start_mark.line + 1}); YAML would keep only the last one, "
                            "silently. To fix: give each key once")
                stack.append((v, (*loc, str(k.value) if isinstance(k, yaml.ScalarNode) else "?"), False))
                stack.append((k, loc, False))
        elif isinstance(node, yaml.SequenceNode):
            stack.extend((c, (*loc, i), False) for i, c in enumerate(node.value))


def _line_of(node: yaml.Node | None, loc: Sequence[int | str]) -> int | None:
    """1-based line of the value at ``loc`` in a composed YAML tree (or of its closest parent)."""
    line = None if node is None else node.start_mark.line + 1
    for key in loc:
        if isinstance(node, yaml.MappingNode):
            # a mapping's keys are scalars whose value is text; a number key (``{2: 35.8}``) is an int in ``loc``
            nxt = next((v for k, v in node.value if k.value in (key, str(key))), None)
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


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict, _REPR.maxtuple, _REPR.maxset = 2, 4, 4, 4, 4
_REPR.maxstring, _REPR.maxlong, _REPR.maxother = 50, 40, 50


def _short(value: Any) -> str:
    """A bounded repr (the value may be a huge list): at most ~60 characters, never the whole value."""
    try:
        text = _REPR.repr(value)
    except ValueError:  # an int beyond Python's 4300-digit repr limit
        return f"<{type(value).__name__}>"
    return text if len(text) <= 60 else text[:57] + "..."


def validation_message(cls: type[BaseModel], err: ValidationError) -> tuple[tuple[int | str, ...], str]:
    """Turn the first pydantic error into ``(loc, "field: message")`` with a did-you-mean."""
    errors = err.errors()
    # A misspelt key shows up as both "unknown" and "missing": the unknown key is the useful message.
    first = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
    loc = tuple(p for p in first["loc"] if not (isinstance(p, str) and p.startswith("function-")))
    kind = first["type"]
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, LocatedError):  # e.g. a boolean inside a list or mapping: name the element
        loc = (*loc, *cause.loc)
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
    return loc, f"{field}: {msg}{got}{_bound_fix(kind, first.get('ctx') or {})}"


_BOUND_FIX = {"less_than_equal": ("le", "at most"), "less_than": ("lt", "less than"),
              "greater_than_equal": ("ge", "at least"), "greater_than": ("gt", "more than")}
"""pydantic's error types of a bound broken, the key of the bound in the error's ``ctx``, and the fix's words."""


def _bound_fix(kind: str, ctx: Mapping[str, Any]) -> str:
    """``. To fix: give at most 100000`` for a number past a field's bound; empty for any other error."""
    key, words = _BOUND_FIX.get(kind, ("", ""))
    bound = ctx.get(key)
    if not isinstance(bound, int | float):
        return ""
    shown = f"{bound:g}" if isinstance(bound, float) and not bound.is_integer() else f"{int(bound)}"
    return f". To fix: give a number {words} {shown}"


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


def where(source: str | Path, loc: Sequence[int | str] | None) -> str:
    """``file:line`` of the field at ``loc`` of a YAML file, for errors found after loading (``file`` alone when
    ``loc`` is None or the file cannot be read again)."""
    if loc is None:
        return str(source)
    try:
        _, node = read_yaml(source)
    except ConfigError:
        return str(source)
    line = _line_of(node, loc)
    return f"{source}:{line}" if line is not None else str(source)


def load_file(cls: type[M], path: str | Path) -> M:
    """Read a YAML file and validate it as ``cls`` (see :func:`parse`)."""
    data, node = read_yaml(path)
    return parse(cls, data, str(path), node)


def did_you_mean(name: str, known: Sequence[str]) -> str:
    """`` did you mean 'x'?`` or an empty string."""
    close = difflib.get_close_matches(name, list(known), n=3, cutoff=0.5)
    return f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
