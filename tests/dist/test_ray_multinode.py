"""Multi-node Ray on this machine (``ray.cluster_utils.Cluster``: several raylets on 127.0.0.1): a node removed
mid-training is a lost rank (``actor death``); the supervisor re-plans on what is left and finishes."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from helpers import RAY_GROUP, SEQ, TinyLM, ramp_tokens
from starverse.checkpoint import CheckpointCallback
from starverse.elastic.supervisor import Supervisor, replan_local
from starverse.runtime.cluster import Cluster, local_plan
from starverse.runtime.launch import RankSpec

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster as RayCluster  # noqa: E402  (needs ray)

from starverse.providers.ray import RayLauncher, _loopback_only  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), pytest.mark.xdist_group(RAY_GROUP)]

STEPS = 8


def _remove_node_at(run_dir: Path, step: int, cluster: RayCluster, node: object, removed: threading.Event) -> None:
    progress = run_dir / "progress.json"
    deadline = time.monotonic() + 400
    while time.monotonic() < deadline:
        try:
            if json.loads(progress.read_text())["step"] >= step:
                cluster.remove_node(node)
                removed.set()
                return
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.05)


def test_a_node_removed_mid_training_is_survived_on_the_remaining_node(tmp_path):
    with _loopback_only(ray):
        cluster = RayCluster(initialize_head=True, head_node_args={
            "num_cpus": 0, "node_ip_address": "127.0.0.1", "include_dashboard": False})
        nodes = [cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1") for _ in range(2)]
        ray.init(address=cluster.address, logging_level="WARNING")
        try:
            assert ray.cluster_resources()["CPU"] == 2 and len([n for n in ray.nodes() if n["Alive"]]) == 3
            ranks = tuple(RankSpec(i, "cpu", "cpu", 1) for i in range(2))
            plan = local_plan(ranks, "tiny", 1, SEQ, 8, precision="fp32")
            sup = Supervisor(
                Cluster(plan=plan, ranks=ranks), tmp_path, checkpoint=CheckpointCallback(interval_steps=2),
                trainer_options={"rebalance_every": 0, "collective_timeout_s": 120.0,
                                 "launcher": RayLauncher(placement_timeout_s=120)},
                replan=replan_local,
            )
            removed = threading.Event()
            killer = threading.Thread(target=_remove_node_at, args=(tmp_path, 3, cluster, nodes[1], removed),
                                      daemon=True)
            killer.start()
            out = sup.run(lambda c: TinyLM(), ramp_tokens(), resume_from=None, per_device_batch_size=2,
                          max_steps=STEPS, seq_len=SEQ)
            assert removed.is_set()
            outcomes = [a.outcome for a in out.attempts]
            assert outcomes[-2:] == ["lost", "completed"], out.attempts
            lost = out.attempts[-2]
            assert "died on node 127.0.0.1" in lost.detail and "Ray actor is gone" in lost.detail
            assert len(lost.device_kinds) == 2 and len(out.attempts[-1].device_kinds) == 1
            assert out.final_step == STEPS and len(sup.cluster.ranks) == 1
            assert ray.cluster_resources()["CPU"] == 1
        finally:
            ray.shutdown()
            cluster.shutdown()
