"""The case file of one FSDP run (one data-parallel group, PP 1, nodes of 8 GPUs; TP 1 unless stated), shared
by the ``make_cases.py`` scripts of ``fms-fsdp/``, ``llm-foundry-scale/``, ``llm-foundry-long/`` and ``opt/``
(they add this folder to ``sys.path``). Not a case: the validation reads ``*.yaml`` only."""

from __future__ import annotations


def fsdp_case_yaml(model: str, train: str, gpus: int, micro_batch: int, accelerator: str, layers: int,
                   node_gbps: int, tokens_per_s: int, source: str, tp: int = 1) -> str:
    """YAML text of the case: ``train`` is the flow mapping's inside (seq_len, global_batch, ...),
    ``source`` a YAML scalar as it is to appear (quoted by the caller); ``gpus`` is the number of
    data-parallel replicas (GPUs / ``tp``)."""
    return (f"model: {model}\n"
            f"train: {{{train}}}\n"
            f"groups:\n- replicas: {gpus}\n  micro_batch: {micro_batch}\n  stages:\n"
            f"  - {{accelerator: {accelerator}, tp: {tp}, layers: {layers}}}\n"
            f"network:\n  devices_per_node: {{{accelerator}: 8}}\n  inter_node_gbps: {{{accelerator}: {node_gbps}}}\n"
            f"measured: {{tokens_per_s: {tokens_per_s}}}\n"
            f"source: {source}\n")
