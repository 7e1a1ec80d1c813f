"""Write Sailor's Clariden (GH200) validation cases from Sailor's own plan files (MIT licence).

Usage, from this folder (SAILOR = a checkout of https://github.com/eth-easl/sailor):

    python make_cases.py SAILOR/sailor/Planner/simulations/validation/clariden

Each ``plan_config_*.json`` there is one measured Megatron-DeepSpeed run of Sailor (Strati et al., SOSP'25)
on CSCS Clariden/Alps nodes of 4 x GH200 (an H100 with 96 GB HBM3, the 4 GPUs of a node joined by NVLink;
4 x 200 Gbit/s Slingshot NICs per node): ``real`` is the measured seconds per iteration, ``max_mem`` the
logged memory per GPU (bytes / 1e9): the ``TOTAL`` of the last line of each rank's memory log
(``ae_scripts/clariden_scripts/process_results.py``), which Sailor's ``deepspeed/pipe_engine.py`` writes after
every pipeline instruction from ``get_total_used_mem`` — the device's used memory (CUDA context, NCCL
buffers, the caching allocator's reserve), hence ``peak_memory_scope: device``. Sailor counts the embedding and the LM head as layers:
a stage's transformer layers are its count minus one on the first and on the last stage
(OPT-350M: 26 = 24 + 2, GPT-Neo-2.7B: 34 = 32 + 2). Every run uses TP 4 inside one node
(``tmp_per_stage``), one replica per node per stage. Training: ``ae_scripts/clariden_scripts/run_opt.slurm``
(fp32: no --fp16/--bf16; seq 2048; DeepSpeed AdamW; no activation checkpointing; ZeRO 0, so DeepSpeed's
``ReduceGrads`` flattens the gradients for their all-reduce: ``flat_grad_allreduce: true``; its pipeline engine
keeps the last stage's outputs in its pipe buffers: ``pipe_buffers_keep_outputs: true``) in the NGC
``pytorch:24.10`` container of Sailor's Dockerfile, which sets ``TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1``
(NGC PyTorch release notes), so fp32 matmuls run as TF32 on the tensor cores: the cases say
``precision: tf32``. Attention is Megatron's unfused softmax path in fp32 (``attention: eager``).
The catalog has no GH200: the cases use ``h100-80gb-sxm`` (the same GH100 die and clocks) with the
GH200's 96 GB stated as ``network.usable_memory_gb`` and Clariden's 4 GPUs and 800 Gbit/s per node.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

MODELS = {"OPT-350": ("opt350m", "models/opt-350m-gpt2style.json"),
          "GPT-NEO": ("gptneo2.7b", "models/gpt-neo-2.7b-gpt2style.json")}
SEQ = 2048
ACC = "h100-80gb-sxm"
MEMORY_EXCLUDED = {
    "GPT-NEO/N8/plan_config_N8_D2.json":
        "28.5 GB logged where the same stages and micro-batch at dp 4, 8 and 16 (N16_D4, N32_D8, N64_D16) log "
        "37.3-37.5 GB: without ZeRO a replica count does not change what a device holds (and Sailor's own "
        "estimator, simulations/runtime_simulator.py get_memory_footprint_on_gpu, gives all four 35.7 GB); "
        "process_results.py get_mem takes the maximum over the rank logs whose last line parses and skips the "
        "others, so a maximum without the first two stages' logs (the model's largest) reads this low",
}
"""Plan files whose ``max_mem`` is kept but not compared (``measured.peak_memory_excluded``), with the evidence."""
LEFT_OUT = {"GPT-NEO/N4/plan_config_N4_D4.json"}
"""Plan files not written (README): this one holds OPT-350M's 26 layers and ``red_grads`` equal to its ``real``."""


def case_yaml(model: str, rel: str, plan: dict) -> tuple[str, str]:
    """(file name, YAML text) of one run."""
    (pipe,) = plan["pipeline_list"]
    counts = [len(s) for s in pipe["layers_per_stage"]]
    layers = list(counts)
    layers[0] -= 1
    layers[-1] -= 1
    tps = {int(r[1]) for stage in pipe["tmp_per_stage"] for r in stage}
    dps = set(pipe["dp"])
    if len(tps) != 1 or len(dps) != 1:
        raise SystemExit(f"{rel}: uneven TP or DP per stage is not handled: {tps} {dps}")
    tp, dp = tps.pop(), dps.pop()
    name, path = MODELS[model]
    mbs, gbs, secs = int(plan["mbs"]), int(plan["gbs"]), float(plan["real"])
    why = MEMORY_EXCLUDED.get(rel.split("clariden/", 1)[-1], "")
    quoted = why.replace("'", "''")
    excluded = f",\n  peak_memory_excluded: '{quoted}'" if why else ""
    stages = "\n".join(f"  - {{accelerator: {ACC}, tp: {tp}, layers: {n}}}" for n in layers)
    text = (f"model: {path}\n"
            f"train: {{seq_len: {SEQ}, global_batch: {gbs}, precision: tf32, mode: full, zero_stage: 0, "
            f"recompute: none, schedule: 1f1b, attention: eager, flat_grad_allreduce: true, "
            f"pipe_buffers_keep_outputs: true}}\n"
            f"groups:\n- replicas: {dp}\n  micro_batch: {mbs}\n  stages:\n{stages}\n"
            f"network:\n  usable_memory_gb: {{{ACC}: 96}}\n  devices_per_node: {{{ACC}: 4}}\n"
            f"  inter_node_gbps: {{{ACC}: 800}}\n"
            f"measured: {{tokens_per_s: {gbs * SEQ / secs:.2f}, step_time_s: {secs}, "
            f"peak_memory_gb: {plan['max_mem'] / 1e9:.2f}, peak_memory_scope: device{excluded}}}\n"
            f"source: 'Sailor (Strati et al., SOSP''25) CSCS Clariden, 4 x GH200 per node, eth-easl/sailor {rel}: "
            f"layers_per_stage {counts} (Sailor layers incl. embedding and head -> transformer layers {layers}), "
            f"tp {tp}, dp {dp}, mbs {mbs}, gbs {gbs}, {plan['N']} nodes; measured {secs} s/iter, max_mem "
            f"{plan['max_mem']} B; fp32 in the NGC 24.10 container (TF32 matmuls)'\n")
    file = f"sailor_gh200-{name}-n{plan['N']}-pp{len(layers)}-dp{dp}-mbs{mbs}-gbs{gbs}.yaml"
    return file, text


def main(root: str) -> None:
    base = Path(root)
    for p in sorted(base.glob("*/N*/plan_config_*.json")):
        if "/".join(p.parts[-3:]) in LEFT_OUT:
            continue
        file, text = case_yaml(p.parts[-3], "sailor/Planner/simulations/validation/clariden/"
                               + "/".join(p.parts[-3:]), json.loads(p.read_text()))
        (Path(__file__).parent / file).write_text(text)


if __name__ == "__main__":
    main(sys.argv[1])
