"""``starverse models``: the bundled model configs (or one model given by id or config.json path)."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table


def models(
    ref: Annotated[
        str | None,
        typer.Argument(
            help="Show only this model: a short id, a Hugging Face id or a path to a config.json.",
            show_default=False,
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON list instead of a table.")] = False,
) -> None:
    """Bundled models (id, HF id, family, parameters, shape) or the shape of one config."""
    from starverse.config import _short, check_path_text
    from starverse.errors import ModelError
    from starverse.models import list_models, load_model

    if ref is not None:
        try:
            check_path_text(ref, "model id or path")
        except ValueError as e:
            raise ModelError(f"{_short(ref)}: {e}. To fix: pass a model id (`starverse models`) or a shorter path") from None
    specs = [load_model(ref)] if ref is not None else list_models()
    if as_json:
        typer.echo(json.dumps([s.summary() for s in specs], indent=1))
        return
    console = Console(highlight=False, soft_wrap=False)
    if not console.is_terminal:
        # piped output would otherwise be squeezed to 80 columns
        console = Console(highlight=False, width=200)
    table = Table(title="Models" if ref is None else f"Model {ref}", title_justify="left")
    for col, just in (
        ("id", "left"), ("HF id", "left"), ("family", "left"), ("params (B)", "right"), ("layers", "right"),
        ("hidden", "right"), ("heads/kv", "right"), ("ffn", "right"), ("vocab", "right"), ("experts", "right"),
        ("position", "left"), ("tied", "left"),
    ):
        table.add_column(col, justify=just, no_wrap=True)  # type: ignore[arg-type]
    for s in specs:
        experts = f"{s.experts_per_token}/{s.num_experts}" if s.num_experts else "-"
        params = f"{s.num_params / 1e9:.3f}"
        if s.num_experts:
            params += f" ({s.num_active_params / 1e9:.1f} active)"
        table.add_row(
            s.name, s.hf_id or "-", s.family, params, str(s.num_layers), str(s.hidden_size),
            f"{s.num_heads}/{s.num_kv_heads}", str(s.ffn_hidden_size), str(s.vocab_size), experts, s.position,
            "yes" if s.tie_embeddings else "no",
        )
    console.print(table)


def register(app: typer.Typer) -> None:
    """Add this area's commands to ``app``."""
    app.command("models")(models)
