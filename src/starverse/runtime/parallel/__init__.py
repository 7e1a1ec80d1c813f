"""The parallelisms inside a pipeline stage: tensor parallel, ZeRO/FSDP2 with offload, recompute.

One job per module: :mod:`.tensor` (Megatron split with DTensor), :mod:`.fsdp` (ZeRO stages with FSDP2),
:mod:`.recompute` (activation checkpointing), :mod:`.blocks` (finding a model's blocks) and
:mod:`.parallelize` (composing them in torchtitan's order).
"""
