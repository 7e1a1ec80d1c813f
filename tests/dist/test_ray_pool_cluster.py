"""``--pool ray://`` on a multi-node Ray cluster on this machine (``ray.cluster_utils.Cluster``, raylets on
127.0.0.1, labelled with catalog accelerator ids): the pool is what the cluster has, and follows nodes that join
or leave; ``starverse plan`` plans on it; a bad label is one line and exit 2."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from helpers import CLI, RAY_GROUP, TINY, new_user_env
from starverse.jobs import prepare_job
from starverse.runtime.callbacks import Callback
from starverse.providers.ray_pool import RayPoolSource

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster as RayCluster  # noqa: E402  (needs ray)

from starverse.providers.ray import _loopback_only  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), pytest.mark.xdist_group(RAY_GROUP)]

JOB = "model: llama-2-7b\ntrain: {seq_len: 4096, global_batch: 128, tokens: 2.0e9}\nobjective: cost-performance\n"


def _counts(src: RayPoolSource) -> dict[str, int]:
    return {o.accelerator: o.count for o in src.pool().offers}


def _until(src: RayPoolSource, want: dict[str, int], timeout_s: float = 60.0) -> dict[str, int]:
    """The pool once it is ``want`` (Ray reports a removed node dead after its raylet is gone)."""
    deadline = time.monotonic() + timeout_s
    while (got := _counts(src)) != want and time.monotonic() < deadline:
        time.sleep(0.2)
    return got


def _plan(tmp: Path, pool: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return subprocess.run([*CLI, "plan", "job.yaml", "--pool", pool, "--json", "--top", "2"], cwd=tmp, env=env,
                          capture_output=True, text=True, timeout=240)


def test_the_pool_is_what_the_cluster_has_and_follows_its_nodes(tmp_path):
    (tmp_path / "job.yaml").write_text(JOB)
    (tmp_path / "prices.yaml").write_text("currency: USD\noffers:\n  - {accelerator: rtx-4090, count: 1, "
                                          "price_per_hour: 0.5}\n  - {accelerator: l40s, count: 1, price_per_hour: 0.9}\n")
    with _loopback_only(ray):
        cluster = RayCluster(initialize_head=True, head_node_args={
            "num_cpus": 0, "node_ip_address": "127.0.0.1", "include_dashboard": False})
        try:
            cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1", resources={"rtx-4090": 8})
            l40s = cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1", resources={"l40s": 4})
            cluster.wait_for_nodes()
            address = cluster.address
            src = RayPoolSource(cluster.address, prices=tmp_path / "prices.yaml")
            pool = src.pool()  # joins as a driver and disconnects
            assert not ray.is_initialized()
            assert [(o.accelerator, o.count, o.devices_per_node, o.price_per_hour) for o in pool.offers] == [
                ("l40s", 4, 4, 0.9), ("rtx-4090", 8, 8, 0.5)]
            assert pool.source == f"ray://{cluster.address}"

            # plan -> what the cluster has (a Ray pool file: the address and the operator's price list)
            (tmp_path / "ray-pool.yaml").write_text(f"ray: {cluster.address}\nprices: prices.yaml\n")
            out = _plan(tmp_path, "ray-pool.yaml")
            assert out.returncode == 0, out.stderr[-3000:]
            plans = json.loads(out.stdout)["plans"]
            assert plans
            for p in plans:
                assert set(p["devices"]) <= {"rtx-4090", "l40s"}, p["devices"]
                assert p["devices"].get("rtx-4090", 0) <= 8 and p["devices"].get("l40s", 0) <= 4, p["devices"]
            best = plans[0]
            assert best["cost_per_hour"] == pytest.approx(
                0.5 * best["devices"].get("rtx-4090", 0) + 0.9 * best["devices"].get("l40s", 0))

            # a node joins, another leaves: the pool follows
            cluster.add_node(num_cpus=2, node_ip_address="127.0.0.1", resources={"rtx-4090": 4})
            assert _until(src, {"l40s": 4, "rtx-4090": 12}) == {"l40s": 4, "rtx-4090": 12}
            cluster.remove_node(l40s)
            assert _until(src, {"rtx-4090": 12}) == {"rtx-4090": 12}

            # bad input through the CLI: a label that is not a catalog id; an unreachable address
            cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1", resources={"rtx4090": 2})
            cluster.wait_for_nodes()
            bad = _plan(tmp_path, f"ray://{cluster.address}")
            assert bad.returncode == 2 and bad.stderr.count("\n") == 1, bad.stderr
            assert bad.stderr.startswith(f"error: ray://{cluster.address}: node 127.0.0.1 has resource 'rtx4090', "
                                         "which is not an accelerator id of the catalog. Did you mean 'rtx-4090'")
        finally:
            cluster.shutdown()
    gone = _plan(tmp_path, f"ray://{address}")  # the cluster is down
    assert gone.returncode == 2 and gone.stderr.count("\n") == 1, gone.stderr
    assert gone.stderr.startswith(f"error: ray://{address}: cannot reach the Ray cluster at {address} (")


@dataclass
class HoldAtStep(Callback):
    """Every rank waits at the end of ``step`` until ``marker`` exists (the test has changed the nodes by then;
    the progress record of this step comes after, so the test waits for the one before)."""

    step: int
    marker: str

    def on_step_end(self, ctx: Any) -> None:
        if ctx.step == self.step:
            deadline = time.monotonic() + 300
            while not Path(self.marker).exists() and time.monotonic() < deadline:
                time.sleep(0.05)


def test_a_job_on_a_ray_pool_replans_on_the_nodes_there_now(tmp_path):
    """``pool: {ray: ADDRESS}``: the job starts on the cluster's two CPU nodes; at step 3 a node joins and one
    leaves; the supervisor asks the cluster again at the re-plan and resumes on two ranks (the joined node's and
    the remaining one), not one; the leases are priced from the operator's price list."""
    (tmp_path / "tiny.json").write_text(json.dumps(TINY))
    (tmp_path / "corpus.txt").write_text(Path(os.__file__).read_text()[:30000])
    (tmp_path / "prices.yaml").write_text("currency: USD\noffers:\n  - {accelerator: cpu, count: 1, "
                                          "price_per_hour: 36}\n")
    with _loopback_only(ray):
        cluster = RayCluster(initialize_head=True, head_node_args={
            "num_cpus": 0, "node_ip_address": "127.0.0.1", "include_dashboard": False})
        nodes = [cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1") for _ in range(2)]
        cluster.wait_for_nodes()
        (tmp_path / "job.yaml").write_text(
            "model: tiny.json\ndataset: corpus.txt\nrun_dir: run\n"
            f"pool: {{ray: '{cluster.address}', prices: prices.yaml}}\n"
            "train: {steps: 8, seq_len: 32, global_batch: 8, micro_batch: 2, rebalance_every: 0}\n"
            "checkpoint: {interval_steps: 2}\nmetrics: {enabled: false}\n")
        ray.init(address=cluster.address, logging_level="WARNING")
        try:
            prepared = prepare_job(tmp_path / "job.yaml")
            assert [r.device_kind for r in prepared.cluster.ranks] == ["cpu", "cpu"]
            assert any("2 x cpu: 36 USD/h each, on-demand (offer 'cpu' of ray://" in line
                       for line in prepared.summary_lines())
            marker = tmp_path / "nodes-changed"
            prepared.supervisor.callbacks = [*prepared.callbacks.accounting, HoldAtStep(3, str(marker))]
            step2 = threading.Event()
            done: list[Any] = []
            # the job runs in a thread: Ray adds nodes from the main thread only
            job = threading.Thread(target=lambda: done.append(prepared.run(
                on_progress=lambda p: step2.set() if p.step >= 2 else None)), daemon=True)
            job.start()
            assert step2.wait(400), "the job never reached step 2"
            cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1")
            cluster.wait_for_nodes()
            cluster.remove_node(nodes[1])
            marker.touch()
            job.join(500)
            assert done, "the job did not finish"
            result = done[0]
        finally:
            ray.shutdown()
            cluster.shutdown()
    outcomes = [a.outcome for a in result.attempts]
    assert outcomes[-2:] == ["lost", "completed"], result.attempts
    assert "Ray actor is gone" in result.attempts[-2].detail
    assert len(result.attempts[-1].device_kinds) == 2 and result.final_step == 8, result.attempts
    assert result.bill is not None and all(le.charge_ticks == 36_000_000 * le.seconds for le in result.bill.leases)


def test_train_on_an_unreachable_ray_pool_is_one_line_and_exit_2(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (tmp_path / "tiny.json").write_text(json.dumps(TINY))
    (tmp_path / "corpus.txt").write_text(Path(os.__file__).read_text()[:2000])
    (tmp_path / "job.yaml").write_text(f"model: tiny.json\ndataset: corpus.txt\npool: {{ray: '127.0.0.1:{port}'}}\n")
    out = subprocess.run([*CLI, "train", "job.yaml"], cwd=tmp_path, env=new_user_env(tmp_path), capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith(f"error: ray://127.0.0.1:{port}: cannot reach the Ray cluster at 127.0.0.1:{port} (")
