"""Write the AMP validation cases from AMP's own results files (not copied here: the AMP repository has no
licence file). Usage, from this folder:

    git clone https://github.com/DachengLi1/AMP /tmp/AMP
    python make_cases.py /tmp/AMP/src/results/homogeneous_results.txt /tmp/AMP/src/results/het_cluster_results.txt

Each "Simulating result" line of those files is one real DeepSpeed run of AMP's GPT-2 (24 layers, h 1024,
16 heads, sequence 1024, global batch 32, fp16 with ``fp32_allreduce``, no activation checkpointing;
examples/ds_pretrain_gpt2_pipe.sh and examples/ds_config.json of that repository; the config's
``wall_clock_breakdown: true`` makes DeepSpeed's pipeline engine time every micro-step with
``torch.cuda.synchronize``, hence ``sync_micro_steps: true``; its
``megatron/model/transformer.py`` ``ParallelTransformerLayerPipe.forward`` runs the layer's forward twice,
``print((super().forward(*args)).shape)`` before ``return super().forward(*args), attention_mask``, hence
``num_layer_forwards: 2``; the script passes neither ``--scaled-upper-triang-masked-softmax-fusion`` nor
``--scaled-masked-softmax-fusion``, both off by default in its ``megatron/arguments.py``, nor
``--attention-softmax-in-fp32`` / ``--apply-query-key-layer-scaling``, so ``FusedScaleMaskSoftmax`` takes the torch
path in fp16 — ``gpt2_attention_mask_func``'s in-place ``masked_fill_`` and ``torch.nn.Softmax`` —, hence
``softmax_fusion: unfused-fp16``) on 4 AWS nodes of 4 GPUs (one cluster placement group, torch 1.7.1+cu110,
i.e. NCCL 2.7.8: AMP's README; its ``.deepspeed_env`` sets ``NCCL_ALGO=^tree,collnet``):
``r_cost`` is the measured seconds per iteration (``inf``: the run did not complete; left out, the source
does not say why). Ranks follow DeepSpeed's pipe/data/model topology (rank = pp·dp·mp index order) over
the hostfile's nodes of 4 ranks; the heterogeneous cluster's last node is the T4 node (het_cluster.py).
The T4 nodes are AWS g4dn instances: AWS G-family instances have no PCIe peer-to-peer between their GPUs
(reported for g5 and g6: NVIDIA/TensorRT-LLM#1034, llm-d-incubation/llm-d-infra#181), hence
``peer_to_peer: {t4: false}``. AMP's partitions count 30 pipeline layer specs: embedding, transpose, 24 transformer layers, transpose,
final norm, tied LM head, fp16->fp32; a stage [a, b) holds the transformer layers among specs 2..25.
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from pathlib import Path

LINE = re.compile(r"Simulating result: None, \[([0-9, ]+)\], (\d+), \{'mp_deg': tensor\(\[(\d+)\.\]\), "
                  r"'dp_deg': tensor\(\[(\d+)\.\]\), 'pp_deg': tensor\(\[(\d+)\.\]\)\}, "
                  r"with p_cost: tensor\(\[([0-9.]+)\]\), r_cost: ([0-9.inf]+)")
GBS, SEQ, GPUS_PER_NODE = 32, 1024, 4
SETTINGS = {
    "homogeneous": {
        "kinds": ["t4"] * 4,
        "source": "4 x g4dn.12xlarge (4 x T4 each, 50 Gbit/s)",
        "network": "  devices_per_node: {t4: 4}\n  inter_node_gbps: {t4: 50}\n  peer_to_peer: {t4: false}\n",
    },
    "het_cluster": {
        "kinds": ["v100-16gb-sxm"] * 3 + ["t4"],
        "source": "3 x p3.8xlarge (4 x V100-16GB NVLink, 10 Gbit/s) + 1 x g4dn.12xlarge (4 x T4, 50 Gbit/s)",
        "network": ("  devices_per_node: {t4: 4, v100-16gb-sxm: 4}\n"
                    "  inter_node_gbps: {t4: 50, v100-16gb-sxm: 10}\n  cross_group_gbps: 10\n"
                    "  peer_to_peer: {t4: false}\n"),
    },
}


def transformer_layers(a: int, b: int) -> int:
    """Transformer layers among pipeline specs [a, b) (specs 2..25 are the 24 transformer layers)."""
    return max(0, min(b, 26) - max(a, 2))


def case_yaml(setting: str, bounds: list[int], mbs: int, mp: int, dp: int, pp: int, seconds: float,
              predicted: float) -> str:
    kinds = SETTINGS[setting]["kinds"]
    layers = [transformer_layers(bounds[i], bounds[i + 1]) for i in range(pp)]
    # replica d's stage s runs on ranks s*dp*mp + d*mp + [0, mp): the node of its first rank
    chains = Counter(tuple(kinds[(s * dp * mp + d * mp) // GPUS_PER_NODE] for s in range(pp)) for d in range(dp))
    groups = []
    for chain, replicas in chains.items():
        stages = "\n".join(f"  - {{accelerator: {k}, tp: {mp}, layers: {n}}}" for k, n in zip(chain, layers, strict=True)
                           if n > 0)
        share = f"\n  batch_share: {replicas / dp:g}" if len(chains) > 1 else ""
        groups.append(f"- replicas: {replicas}\n  micro_batch: {mbs}{share}\n  stages:\n{stages}")
    if any(n == 0 for n in layers):
        raise SystemExit(f"a stage without transformer layers: {bounds}")
    tokens = GBS * SEQ / seconds
    return (f"model: ../models/gpt2-medium-megatron.json\n"
            f"train: {{seq_len: {SEQ}, global_batch: {GBS}, precision: fp16, mode: full, zero_stage: 0, "
            f"recompute: none, schedule: 1f1b, grad_reduce_fp32: true, sync_micro_steps: true, "
            f"overlap_grad_reduce: false, num_layer_forwards: 2, softmax_fusion: unfused-fp16}}\n"
            f"groups:\n" + "\n".join(groups) + "\nnetwork:\n" + SETTINGS[setting]["network"] +
            f"measured: {{tokens_per_s: {tokens:.2f}, step_time_s: {seconds}}}\n"
            f"source: 'AMP (Li et al., NeurIPS 2022, arXiv:2210.07297) {SETTINGS[setting]['source']}; "
            f"DachengLi1/AMP src/results/{setting}_results.txt: partition {bounds}, mbs {mbs}, mp {mp}, dp {dp}, "
            f"pp {pp}, r_cost {seconds} s/iter (AMP cost model: {predicted} s); tokens/s = 32 x 1024 / r_cost'\n")


def main(paths: list[str]) -> None:
    for path in paths:
        setting = Path(path).name.removesuffix("_results.txt")
        out = Path(__file__).parent / {"homogeneous": "t4", "het_cluster": "mixed"}[setting]
        out.mkdir(exist_ok=True)
        seen: Counter[str] = Counter()
        for m in LINE.finditer(Path(path).read_text()):
            bounds = [int(x) for x in m.group(1).split(",")]
            mbs, mp, dp, pp = (int(m.group(i)) for i in (2, 3, 4, 5))
            if m.group(7) == "inf":
                continue
            name = f"amp_{out.name}-mp{mp}-dp{dp}-pp{pp}-mbs{mbs}"
            seen[name] += 1
            if seen[name] > 1:
                name += f"-{seen[name]}"
            (out / f"{name}.yaml").write_text(case_yaml(setting, bounds, mbs, mp, dp, pp, float(m.group(7)),
                                                        float(m.group(6))))


if __name__ == "__main__":
    main(sys.argv[1:])
