"""The parallelisms of a plan: pipeline stages and schedules, and inside a stage tensor parallel, ZeRO/FSDP2 with
offload, recompute.

One job per module: :mod:`.tensor` (Megatron split with DTensor), :mod:`.fsdp` (ZeRO stages with FSDP2),
:mod:`.recompute` (activation checkpointing), :mod:`.blocks` (finding a model's blocks) and
:mod:`.parallelize` (composing them in torchtitan's order); :mod:`.pipeline_layout` (where each rank sits),
:mod:`.pipeline_split` (cutting a model into chunks), :mod:`.pipeline` (stages and schedules) and
:mod:`.pipeline_report` (measured next to predicted).
"""
