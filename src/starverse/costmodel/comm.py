"""Collective and point-to-point times over intra- and inter-node links (numpy, vectorised).

Bandwidths here are GB/s = 1e9 bytes/s; a NIC's Gbit/s is divided by 8 by the caller.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from starverse.costmodel.constants import (
    COLLECTIVE_LATENCY_S,
    CPU_COLLECTIVE_LATENCY_S,
    CPU_DTENSOR_COLLECTIVE_S,
    LINK_EFFICIENCY,
    NCCL_BASE_LATENCY_S,
    NCCL_INTRA_RING_STEP_S,
    NCCL_INTRA_TREE_STEP_S,
    NCCL_NET_RING_STEP_S,
    NCCL_NET_TREE_STEP_S,
    NETWORK_EFFICIENCY,
)

FloatArray = npt.NDArray[np.float64]


def ring_allreduce_s(bytes_: Any, n: Any, bus_gb_per_s: Any, count: Any = 1.0,
                     latency_s: Any = COLLECTIVE_LATENCY_S) -> FloatArray:
    """All-reduce of ``bytes_`` (in total, split over ``count`` collectives) over ``n`` ranks.

    Bandwidth term of a ring: each rank sends and receives 2(n-1)/n of the data at the achieved bus
    bandwidth ``bus_gb_per_s``; latency term: ``count`` collectives of 2*log2(n) steps of ``latency_s`` each
    (NCCL's by default; :func:`collective_latency_s` per row). Zero for n <= 1.
    """
    n_ = np.maximum(np.asarray(n, dtype=np.float64), 1.0)
    b = np.asarray(bytes_, dtype=np.float64)
    bw = np.maximum(np.asarray(bus_gb_per_s, dtype=np.float64), 1e-9) * 1e9
    t = 2.0 * (n_ - 1.0) / n_ * b / bw + np.asarray(count) * 2.0 * np.log2(n_) * np.asarray(latency_s)
    return np.asarray(np.where(n_ > 1.0, t, 0.0), dtype=np.float64)


def group_bus_gb_per_s(
    group_size: Any,
    members_per_node: Any,
    intra_gb_per_s: Any,
    devices_per_node: Any,
    inter_node_gbps: Any,
) -> FloatArray:
    """Achieved bus bandwidth of a collective over ``group_size`` ranks, ``members_per_node`` of them per node.

    Inside one node the ring runs over the device links (``LINK_EFFICIENCY`` of the per-device link).
    Across nodes NCCL runs one ring per NIC rail; the node's NIC bandwidth is shared by the
    ``devices_per_node / members_per_node`` groups that talk at the same time, so this group gets
    ``members_per_node / devices_per_node`` of it (hierarchical: the slower of the two levels bounds).
    """
    g = np.maximum(np.asarray(members_per_node, dtype=np.float64), 1.0)
    n = np.asarray(group_size, dtype=np.float64)
    intra = np.asarray(intra_gb_per_s, dtype=np.float64) * LINK_EFFICIENCY
    dpn = np.maximum(np.asarray(devices_per_node, dtype=np.float64), 1.0)
    node_gb_per_s = np.asarray(inter_node_gbps, dtype=np.float64) / 8.0 * NETWORK_EFFICIENCY
    inter = node_gb_per_s * np.minimum(g, dpn) / dpn
    # a device without any intra-node link (intra 0) still reaches its NIC through the host
    intra_or_inter = np.where(intra > 0, intra, inter)
    cross = np.minimum(intra_or_inter, inter)
    return np.asarray(np.where(n <= g, intra_or_inter, cross), dtype=np.float64)


def nccl_latency_s(ranks: Any, nodes: Any, all_reduce: bool) -> FloatArray:
    """Latency of one NCCL collective (Simple protocol) over ``ranks`` ranks spread over ``nodes`` nodes, as NCCL's
    own tuning model prices it (NVIDIA/nccl ``src/graph/tuning.cc``, ``ncclTopoTuneModel``; constants
    ``NCCL_*`` in :mod:`costmodel.constants`). A ring takes ``ranks - 1`` steps (all-gather, reduce-scatter;
    twice that for an all-reduce), ``nodes - 1`` of them (twice) over the network, so its latency grows linearly
    with the ring; an all-reduce may instead run as a tree (``2 (ranks/nodes - 1)`` steps inside the nodes and
    ``2 log2(nodes)`` across them) and NCCL picks the faster of the two. All-gather and reduce-scatter have no
    tree (NCCL's PAT algorithm covers only one rank per node). Zero for one rank."""
    n = np.maximum(np.asarray(ranks, dtype=np.float64), 1.0)
    nodes_ = np.clip(np.asarray(nodes, dtype=np.float64), 1.0, n)
    hops = 2.0 if all_reduce else 1.0
    lat = NCCL_BASE_LATENCY_S + hops * ((n - nodes_) * NCCL_INTRA_RING_STEP_S + (nodes_ - 1.0) * NCCL_NET_RING_STEP_S)
    if all_reduce:
        tree = NCCL_BASE_LATENCY_S + 2.0 * ((n / nodes_ - 1.0) * NCCL_INTRA_TREE_STEP_S
                                            + np.log2(nodes_) * NCCL_NET_TREE_STEP_S)
        lat = np.minimum(lat, tree)
    return np.asarray(np.where(n > 1.0, lat, 0.0), dtype=np.float64)


def dp_ring_members(replicas: Any, tp: Any, devices_per_node: Any) -> FloatArray:
    """Ranks of one data-parallel ring on one node: DP neighbours sit next to each other after the TP ranks
    (Megatron/DeepSpeed rank order), so ``min(replicas, devices_per_node // tp)`` (at least 1)."""
    dpn = np.maximum(np.asarray(devices_per_node, dtype=np.float64), 1.0)
    return np.asarray(np.minimum(np.asarray(replicas, dtype=np.float64),
                                 np.maximum(np.floor(dpn / np.asarray(tp, dtype=np.float64)), 1.0)), dtype=np.float64)


def dp_ring_bus(replicas: Any, tp: Any, intra_gb_per_s: Any, devices_per_node: Any,
                inter_node_gbps: Any) -> tuple[FloatArray, FloatArray]:
    """Bus bandwidth of a data-parallel ring over ``replicas`` ranks of TP degree ``tp`` and the share of the
    node's NIC that ring gets (``members / devices_per_node``: the other TP ranks' and stages' rings on the
    node cross its NIC at the same time). DP neighbours sit next to each other after the TP ranks on a node
    (Megatron/DeepSpeed rank order), so ``members = min(replicas, devices_per_node // tp)``."""
    dpn = np.maximum(np.asarray(devices_per_node, dtype=np.float64), 1.0)
    members = dp_ring_members(replicas, tp, dpn)
    bus = group_bus_gb_per_s(replicas, members, intra_gb_per_s, dpn, inter_node_gbps)
    return bus, np.asarray(np.minimum(members, dpn) / dpn, dtype=np.float64)


def collective_latency_s(host_collectives: Any, dtensor: bool = False) -> Any:
    """Latency of one step of a collective (``ring_allreduce_s``'s ``latency_s``) per row: NCCL's
    :data:`~starverse.costmodel.constants.COLLECTIVE_LATENCY_S`, or for rows of CPU ranks (``host_collectives``
    True; None: no such row) gloo's measured per-call latency, and for their DTensor collectives (``dtensor``:
    TP all-reduces, ZeRO-3 gathers) the measured per-call cost (``CPU_DTENSOR_COLLECTIVE_S``, measured at 2
    ranks: 2 latency steps)."""
    if host_collectives is None:
        return COLLECTIVE_LATENCY_S
    cpu = CPU_DTENSOR_COLLECTIVE_S / 2.0 if dtensor else CPU_COLLECTIVE_LATENCY_S
    return np.where(np.asarray(host_collectives, dtype=np.bool_), cpu, COLLECTIVE_LATENCY_S)
