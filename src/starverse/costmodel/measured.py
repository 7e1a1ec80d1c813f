"""What a plan says was measured, for the scalar estimate (``costmodel.step``): the profiles it names
(``network.profiles``: layer, head and optimizer times) and the intra-node collective bandwidths
(``network.collective_gb_per_s``, or a profile's ``intra_node`` link)."""

from __future__ import annotations

from typing import Any

import numpy as np

from starverse.costmodel import constants as C
from starverse.costmodel.profile import ModelProfile, check_profile_fits, load_profile
from starverse.costmodel.shapes import ModelShape
from starverse.errors import ConfigError
from starverse.plan import Plan


def plan_profiles(plan: Plan, shape: ModelShape) -> dict[str, ModelProfile]:
    """The measured profiles a plan names (``network.profiles``), loaded and checked against the stage's
    accelerator and the plan's model shape (ConfigError naming the field otherwise)."""
    out: dict[str, ModelProfile] = {}
    for acc_id, path in plan.network.profiles.items():
        where = f"network.profiles.{acc_id}"
        try:
            prof = load_profile(path)
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None
        check_profile_fits(prof, acc_id, shape, where)
        out[acc_id] = prof
    return out


def measured_layer_times(profiles: dict[str, ModelProfile], stages: list[Any], micro_batches: np.ndarray, seq_len: int,
              precision: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(layer fwd+bwd, layer fwd, head fwd+bwd) per stage and micro-batch choice, NaN where not measured."""
    shape = (len(stages), len(micro_batches))
    layer, fwd, head = np.full(shape, np.nan), np.full(shape, np.nan), np.full(shape, np.nan)
    for i, st in enumerate(stages):
        prof = profiles.get(st.accelerator)
        if prof is None:
            continue
        for j, mb in enumerate(micro_batches):
            e = prof.entry(int(mb), seq_len, st.tp, precision)
            if e is not None:
                layer[i, j] = e.layer_forward_s + e.layer_backward_s
                fwd[i, j] = e.layer_forward_s
                head[i, j] = e.head_forward_s + e.head_backward_s
    return layer, fwd, head


def optimizer_s_per_param(profiles: dict[str, ModelProfile], acc_id: str) -> float:
    """A profile's measured Adam step time per parameter held; NaN = analytic."""
    prof = profiles.get(acc_id)
    return np.nan if prof is None or prof.optimizer_s_per_param is None else prof.optimizer_s_per_param


def intra_node_gb_per_s(plan: Plan, acc: Any, tp: int, profiles: dict[str, ModelProfile]) -> float:
    """Per-device intra-node bandwidth: a profile's or the plan's measured bus bandwidth (``network.
    collective_gb_per_s`` for a group of ``tp``; divided by the efficiency the model applies to datasheet
    links), else the catalog's."""
    prof = profiles.get(acc.id)
    if prof is not None and "intra_node" in prof.links_gb_per_s:
        return prof.links_gb_per_s["intra_node"] / C.LINK_EFFICIENCY
    measured = plan.network.collective_gb_per_s.get(acc.id, {}).get(tp)
    if measured is not None:
        return measured / C.LINK_EFFICIENCY
    return C.intra_node_gb_per_s(acc, plan.network.peer_to_peer.get(acc.id))
