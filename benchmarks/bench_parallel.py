"""Parallelism benchmark: pipelines on CPU ranks against the cost model and against an even split.

Prints ONE JSON object; each figure is a ratio or an error against something measured or predicted in the same run:

- ``pp_bubble_error``: a 4-stage 1F1B pipeline (a small Llama, 8 layers as 2+2+2+2, 8 micro-batches) on 4 CPU
  ranks: measured bubble fraction (``FitResult.pipeline.bubble``: 1 - busiest stage's compute / step wall time,
  first step left out) minus the cost model's (``pipeline_bubble`` / step time for the same plan). Target
  ``|error| <= 0.25``.
- ``hetero_pp_vs_even``: a 2-stage pipeline whose second rank is slowed 3x (``starverse.testing.SlowRank``):
  throughput with the planner's uneven split (``planner.hetero.split_layers`` over the stages' relative speeds
  1 : 1/3, as a probe profile reports them) over throughput with an even split. Target ``>= 1.5``.

The machine is shared: every figure comes from one run of each configuration, interleaved, best of two.
"""

from __future__ import annotations

import json
import logging
import sys
import tempfile
from pathlib import Path
from typing import Any

SEQ, MB, GB, LAYERS, VOCAB = 64, 1, 8, 8, 256


def _config(layers: int = LAYERS) -> dict[str, Any]:
    return {
        "model_type": "llama", "hidden_size": 128, "intermediate_size": 344, "num_hidden_layers": layers,
        "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": VOCAB, "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "hidden_act": "silu",
    }


def _tokens() -> list[Any]:
    import torch

    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (SEQ * 8,), generator=g) for _ in range(32)]


def _fit(work: Path, tag: str, stages: list[tuple[str, int]], steps: int, callbacks: list[Any]) -> Any:
    from starverse.plan import Group, Plan, Stage, TrainSpec
    from starverse.runtime.cluster import Cluster
    from starverse.runtime.launch import RankSpec
    from starverse.runtime.modeling import build_model
    from starverse.runtime.trainer import Trainer

    cfg_path = work / "config.json"
    cfg_path.write_text(json.dumps(_config()))
    plan = Plan(model=str(cfg_path), train=TrainSpec(seq_len=SEQ, global_batch=GB, precision="fp32"),
                groups=[Group(micro_batch=MB, stages=[Stage(accelerator=k, layers=n) for k, n in stages])])
    ranks = tuple(RankSpec(r, k, "cpu", num_threads=1) for r, (k, _) in enumerate(stages))
    trainer = Trainer(Cluster(plan=plan, ranks=ranks), callbacks=callbacks, run_dir=work / tag, rebalance_every=0,
                      timeout_s=600)
    return trainer.fit(build_model(_config()), dataset=_tokens(), per_device_batch_size=MB, max_steps=steps,
                       seq_len=SEQ, global_batch=GB, tokenizer="bytes")


def _steady_tps(res: Any) -> float:
    times = res.step_times_s[1:] or res.step_times_s
    return GB * SEQ * len(times) / sum(times)


def main() -> None:
    """Run the configurations and print the JSON object."""
    logging.basicConfig(level=logging.WARNING)
    from starverse.planner.hetero import split_layers
    from starverse.testing import SlowRank

    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        best: dict[str, Any] = {}
        for attempt in range(2):
            res = _fit(work, f"pp4-{attempt}", [("cpu", 2)] * 4, 5, [])
            report = res.pipeline
            if report is not None and (best.get("pp4") is None or report.bubble < best["pp4"].bubble):
                best["pp4"] = report
        rep = best["pp4"]
        out["pp_bubble_measured"] = round(rep.bubble, 4)
        out["pp_bubble_predicted"] = None if rep.predicted_bubble is None else round(rep.predicted_bubble, 4)
        out["pp_bubble_error"] = (None if rep.predicted_bubble is None
                                  else round(rep.bubble - rep.predicted_bubble, 4))

        uneven = split_layers([1.0, 1.0 / 3.0], LAYERS)
        even = [LAYERS // 2, LAYERS - LAYERS // 2]
        tps: dict[str, float] = {"uneven": 0.0, "even": 0.0}
        for attempt in range(2):
            for tag, split in (("uneven", uneven), ("even", even)):
                res = _fit(work, f"{tag}-{attempt}", [("cpu", split[0]), ("cpu", split[1])], 5, [SlowRank(1, 3.0)])
                tps[tag] = max(tps[tag], _steady_tps(res))
        out["hetero_pp_split_uneven"] = uneven
        out["hetero_pp_split_even"] = even
        out["hetero_pp_vs_even"] = round(tps["uneven"] / tps["even"], 3)
    json.dump(out, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
