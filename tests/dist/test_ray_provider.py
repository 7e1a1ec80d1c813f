"""The Ray provider: ranks as Ray actors (real processes, real gloo), one machine, 127.0.0.1 only.

The same ``Trainer.fit`` through Ray gives the local launcher's losses and weights; a killed Ray worker, a
rank's exception, a user error, an overrun, a cluster too small and a refused join each end in the error
the local launcher would raise (or say what to do), and nothing of the job is left running.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

# TinyLM lives in tests/helpers.py, not an installed module: the Ray ranks must import it as spawn would.
from helpers import RAY_GROUP, SEQ, TinyLM, process_gone
from helpers import ramp_tokens as _tokens
from starverse.errors import ConfigError, DistributedError, JobTimeoutError, LossCause, LostRankError, RankCodeError
from starverse.runtime.callbacks import Callback
from starverse.runtime.cluster import Cluster, local_plan
from starverse.runtime.launch import RankSpec, launch
from starverse.runtime.trainer import Trainer
from starverse.testing import KillRank

ray = pytest.importorskip("ray")
from starverse.providers.ray import RayLauncher, _loopback_only  # noqa: E402  (needs ray)

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group(RAY_GROUP)]

MB, GB, STEPS = 2, 16, 5


class WhereAmI(Callback):
    """Each rank records its pid and whether it runs inside a Ray worker (proof of which launcher ran it)."""

    def on_fit_start(self, ctx):
        import ray as _ray

        inside = _ray.is_initialized() and _ray.get_runtime_context().get_actor_id() is not None
        (ctx.run_dir / f"where-{ctx.rank}.txt").write_text(f"{os.getpid()} {int(inside)}")


def _cluster(n: int = 2) -> Cluster:
    ranks = tuple(RankSpec(r, "cpu", "cpu", num_threads=1) for r in range(n))
    return Cluster(plan=local_plan(ranks, "tiny", 1, SEQ, GB, precision="fp32"), ranks=ranks)


def _fit(model, run_dir: Path, launcher, callbacks=(), **kw):
    trainer = Trainer(
        _cluster(), callbacks=list(callbacks), run_dir=run_dir, lr=2e-2, warmup_steps=2, grad_clip=0.5,
        rebalance_every=0, timeout_s=240, collective_timeout_s=60, launcher=launcher, **kw,
    )
    return trainer.fit(model, dataset=_tokens(), per_device_batch_size=MB, max_steps=STEPS, seq_len=SEQ,
                       global_batch=GB, shares=[3, 5])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _wait_until(cond, limit_s: float = 20.0) -> bool:
    """Poll ``cond`` (Ray releases resources and reaps workers asynchronously); False if it never held."""
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.2)
    return cond()


def test_fit_on_ray_equals_the_local_launcher_and_shuts_ray_down(tmp_path):
    """Same seed, same uneven shares: Ray ranks give the local launcher's losses and weights (fp32)."""
    assert not ray.is_initialized()
    torch.manual_seed(0)
    local_model = TinyLM()
    ray_model = copy.deepcopy(local_model)
    local = _fit(local_model, tmp_path / "local", "local", [WhereAmI()])
    on_ray = _fit(ray_model, tmp_path / "ray", "ray", [WhereAmI()])

    where = [(tmp_path / "ray" / f"where-{r}.txt").read_text().split() for r in range(2)]
    assert [w[1] for w in where] == ["1", "1"]  # both ranks ran inside Ray actors ...
    assert [(tmp_path / "local" / f"where-{r}.txt").read_text().split()[1] for r in range(2)] == ["0", "0"]
    pids = [int(w[0]) for w in where]
    assert len(set(pids)) == 2 and os.getpid() not in pids  # ... one process per rank, not this one

    assert on_ray.steps == local.steps == STEPS
    assert local.losses[-1] < local.losses[0] - 0.1  # it learned: not a comparison of untouched models
    torch.testing.assert_close(torch.tensor(on_ray.losses), torch.tensor(local.losses))
    for name, value in ray_model.state_dict().items():
        torch.testing.assert_close(value, local_model.state_dict()[name], msg=name)
    assert on_ray.ranks[0].final_share == 3 and on_ray.ranks[1].final_share == 5

    # The provider started a private session, so it shut it down: no Ray left here, the rank workers gone.
    assert not ray.is_initialized()
    assert _wait_until(lambda: not any(_alive(p) for p in pids)), pids


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def _ray_head(env: dict[str, str]):
    """A real `ray start --head` on 127.0.0.1 (as on a cluster's head node), stopped by its own pid."""
    port = _free_port()
    cmd = [
        str(Path(sys.executable).with_name("ray")), "start", "--head", "--block", "--node-ip-address=127.0.0.1",
        f"--port={port}", "--num-cpus=2", "--include-dashboard=false", f"--dashboard-port={_free_port()}",
        f"--dashboard-agent-listen-port={_free_port()}",
        "--object-store-memory=100000000", "--disable-usage-stats",
    ]
    # Ray's switch that keeps a head given 127.0.0.1 on the loopback interface (see providers/ray.py).
    head = subprocess.Popen(cmd, env={**env, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        def up() -> bool:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
                return True
            return False

        assert _wait_until(up, 60), "ray start --head did not open its port"
        yield f"127.0.0.1:{port}"
    finally:
        head.send_signal(signal.SIGTERM)  # --block: the head stops the processes it started
        try:
            head.wait(timeout=40)
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait()


_DRIVER = """
import json, os, sys
import torch, torch.distributed as dist
from starverse.errors import DistributedError
from starverse.runtime.launch import RankSpec, launch

def add(env, offset):
    t = torch.tensor([float(env.rank + offset)])
    dist.all_reduce(t)
    return [env.rank, os.environ["MASTER_ADDR"], t.item()]

if __name__ == "__main__":
    import ray
    try:
        out = launch(add, [RankSpec(r, "cpu", "cpu", num_threads=1) for r in range(2)], timeout_s=90, args=(1,),
                     launcher="ray")
    except DistributedError as e:
        print(json.dumps({"error": str(e), "connected_after": ray.is_initialized()}))
        sys.exit(0)
    print(json.dumps({"out": out, "connected_after": ray.is_initialized()}))
"""


def test_joins_an_existing_cluster_through_ray_address(tmp_path):
    """RAY_ADDRESS: a driver joins a `ray start --head` cluster (token authentication, Ray's default), runs
    its ranks there and disconnects; without the token the join is refused with what to set.

    Each driver is a fresh process, as a user's would be (Ray caches its authentication mode per process).
    """
    token = uuid.uuid4().hex
    base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    script = tmp_path / "driver.py"
    script.write_text(_DRIVER)
    with _ray_head({**base, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}) as address:
        drivers = {
            "with_token": {**base, "RAY_ADDRESS": address, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token},
            "without": {**base, "RAY_ADDRESS": address, "HOME": str(tmp_path)},  # no ~/.ray/auth_token either
        }
        procs = {
            name: subprocess.Popen([sys.executable, str(script)], env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
            for name, env in drivers.items()
        }
        res = {}
        for name, proc in procs.items():
            out, err = proc.communicate(timeout=150)
            assert proc.returncode == 0, err[-3000:]
            res[name] = json.loads(out.strip().splitlines()[-1])
    assert res["with_token"] == {"out": [[0, "127.0.0.1", 3.0], [1, "127.0.0.1", 3.0]], "connected_after": False}
    refused = res["without"]["error"]
    assert re.match(rf"cannot join the Ray cluster at {address}: ray\.exceptions\.AuthenticationError: .*To fix: "
                    r"start it with `ray start --head`.* set RAY_AUTH_MODE=token with its token in ~/\.ray/auth_token, "
                    r"RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN", refused), refused


def test_launcher_choice_is_checked_up_front(monkeypatch):
    with pytest.raises(ConfigError, match=r"unknown launcher 'rey': expected one of 'local', 'ray' or an object "
                       r"with a launch\(\) method\. Did you mean 'ray'\?"):
        Trainer(_cluster(), launcher="rey")
    with pytest.raises(ConfigError, match=r"launcher object has no launch\(\) method"):
        Trainer(_cluster(), launcher=object())  # type: ignore[arg-type]
    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed
    with pytest.raises(ConfigError, match=r"launcher='ray' needs Ray, which is not installed\. To fix: pip install "
                       r"'starverse\[ray\]'"):
        Trainer(_cluster(), launcher="ray")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_cpus_per_rank": -1}, r"num_cpus_per_rank must be >= 0 \(got -1\)"),
        ({"placement_timeout_s": 0}, r"placement_timeout_s must be > 0 \(got 0\)"),
        ({"object_store_memory_mb": 10}, r"object_store_memory_mb must be >= 75, Ray's minimum \(got 10\)"),
    ],
)
def test_ray_launcher_options_are_validated(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        RayLauncher(**kwargs)


@pytest.fixture(scope="module")
def ray_session():
    """One private loopback session for the tests below (the provider must leave a caller's session up)."""
    with _loopback_only(ray):
        ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False, num_cpus=2,
                 resources={"kind-a": 1}, object_store_memory=100 * 1024 * 1024, logging_level="WARNING")
        try:
            yield ray
        finally:
            ray.shutdown()


def _all_cpus_free() -> bool:
    return ray.available_resources().get("CPU", 0.0) == ray.cluster_resources().get("CPU", -1.0)


def test_killed_ray_worker_is_a_distributed_error_naming_the_rank(tmp_path, ray_session):
    with pytest.raises(DistributedError, match=r"rank 1 \(cpu, cpu\) died on node 127\.0\.0\.1: its Ray actor is "
                       r"gone without reporting a result") as err:
        _fit(TinyLM(), tmp_path, "ray", [KillRank(rank=1, step=2, signal=signal.SIGKILL)])
    assert err.value.failed_rank == 1
    assert err.value.rank_exitcode is None  # Ray does not report a worker's exit status
    e = err.value
    assert isinstance(e, LostRankError) and (e.rank, e.device_kind, e.node, e.cause) == (
        1, "cpu", "127.0.0.1", LossCause.ACTOR_DIED)
    # The caller's session is left running, and the job's actors and placement group are gone.
    assert ray.is_initialized()
    assert _wait_until(_all_cpus_free), ray.available_resources()


def _sum_ranks(env, offset):
    import torch.distributed as dist

    t = torch.tensor([float(env.rank + offset)])
    dist.all_reduce(t)
    return (env.rank, os.environ["MASTER_ADDR"], t.item(), env.extra["local_rank"], env.extra["launcher"])


def _fail(env, victim, how):
    import torch.distributed as dist

    if env.rank == victim:
        if how == "user":
            raise ConfigError("dataset 'x' is empty")
        raise RuntimeError("boom in rank code")
    dist.all_reduce(torch.ones(1))  # the survivor waits on the victim: it must not hang the job
    time.sleep(60)


def _hang(env):
    time.sleep(120)


def _ranks(n: int) -> list[RankSpec]:
    return [RankSpec(r, "cpu", "cpu", num_threads=1) for r in range(n)]


def test_launch_through_ray_reuses_the_callers_session(ray_session):
    out = launch(_sum_ranks, _ranks(2), timeout_s=60, args=(10,), launcher=RayLauncher())
    # Rendezvous on rank 0's node IP (loopback here); local ranks counted per node.
    assert out == [(0, "127.0.0.1", 21.0, 0, "ray"), (1, "127.0.0.1", 21.0, 1, "ray")]
    assert ray.is_initialized()


def test_rank_exception_names_the_rank_and_user_errors_stay_themselves(ray_session):
    with pytest.raises(DistributedError, match=r"rank 0 \(cpu, cpu\) failed on node 127\.0\.0\.1: "
                       r"RuntimeError: boom in rank code; the other ranks were stopped") as err:
        launch(_fail, _ranks(2), timeout_s=60, args=(0, "raise"), collective_timeout_s=30, launcher="ray")
    assert err.value.failed_rank == 0
    assert isinstance(err.value, RankCodeError) and err.value.node == "127.0.0.1"
    assert err.value.error == "RuntimeError: boom in rank code"
    with pytest.raises(ConfigError, match="dataset 'x' is empty"):
        launch(_fail, _ranks(2), timeout_s=60, args=(1, "user"), collective_timeout_s=30, launcher="ray")
    assert _wait_until(_all_cpus_free), ray.available_resources()


def test_job_timeout_stops_every_rank(ray_session):
    # (on a busy machine the 4 s may already run out while Ray starts the actors: same error, other count)
    with pytest.raises(JobTimeoutError, match=r"did not finish within 4 s \(\d/\d ranks (done|ready).*\); all ranks "
                       r"were stopped"):
        launch(_hang, _ranks(2), timeout_s=4, launcher="ray")
    assert _wait_until(_all_cpus_free), ray.available_resources()


def test_a_cluster_too_small_fails_with_what_it_lacks(ray_session):
    with pytest.raises(DistributedError, match=r"cannot place 3 ranks within 1 s: they need 3 CPUs and 0 GPUs, "
                       r"the cluster has 2 CPUs and 0 GPUs .* To fix: add nodes"):
        launch(_sum_ranks, _ranks(3), timeout_s=60, args=(0,), launcher=RayLauncher(placement_timeout_s=1))
    assert _wait_until(_all_cpus_free), ray.available_resources()


def test_kind_resources_pin_ranks_to_nodes_of_their_kind(ray_session):
    """A rank pinned to a node resource is placed only where it exists (here: the one node has kind-a)."""
    pinned = RayLauncher(kind_resources={"cpu": "kind-a"})
    assert [o[:3] for o in launch(_sum_ranks, _ranks(2), timeout_s=60, args=(0,), launcher=pinned)] == [
        (0, "127.0.0.1", 1.0), (1, "127.0.0.1", 1.0)
    ]
    mixed = [RankSpec(0, "cpu", "cpu", num_threads=1), RankSpec(1, "cpu-b", "cpu", num_threads=1)]
    nowhere = RayLauncher(kind_resources={"cpu": "kind-a", "cpu-b": "kind-b"}, placement_timeout_s=1)
    with pytest.raises(DistributedError, match=r"No node has the resource\(s\) \['kind-b'\] that kind_resources "
                       r"pins ranks to\. To fix: .*correct RayLauncher\.kind_resources"):
        launch(_sum_ranks, mixed, timeout_s=60, args=(0,), launcher=nowhere)
    assert _wait_until(_all_cpus_free), ray.available_resources()


def _refuse_to_unpickle():
    raise RuntimeError("cannot rebuild this argument on the node")


class _Unshippable:
    """An argument that pickles but cannot be rebuilt in the rank (a module missing on the node, say)."""

    def __reduce__(self):
        return (_refuse_to_unpickle, ())


def test_an_argument_the_ranks_cannot_unpickle_names_the_cause(ray_session):
    with pytest.raises(DistributedError, match=r"rank 0 \(cpu, cpu\) failed on node 127\.0\.0\.1: RuntimeError: "
                       r"cannot rebuild this argument on the node; the other ranks were stopped") as err:
        launch(_sum_ranks, _ranks(2), timeout_s=60, args=(_Unshippable(),), launcher="ray")
    assert err.value.failed_rank == 0
    assert _wait_until(_all_cpus_free), ray.available_resources()


def _stop_rank_1(env, pid_file):
    import torch.distributed as dist

    if env.rank == 1:
        Path(pid_file).write_text(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGSTOP)  # alive but silent: its actor is not dead, only its heartbeat stops
    dist.all_reduce(torch.ones(1))  # the survivor waits on it until the heartbeat ends the job
    time.sleep(60)


def test_a_stopped_ray_actor_is_lost_by_its_heartbeat_and_killed(tmp_path, ray_session):
    fast = RayLauncher(heartbeat_s=0.2, heartbeat_timeout_s=3.0)
    t0 = time.monotonic()
    with pytest.raises(LostRankError, match=r"rank 1 \(cpu, cpu\) on node 127\.0\.0\.1 sent no heartbeat for \d+ s; "
                       r"it was stopped with the other ranks") as err:
        launch(_stop_rank_1, _ranks(2), timeout_s=100, args=(str(tmp_path / "pid"),), collective_timeout_s=60,
               launcher=fast)
    e = err.value
    assert (e.rank, e.device_kind, e.node, e.cause) == (1, "cpu", "127.0.0.1", LossCause.HEARTBEAT)
    assert time.monotonic() - t0 < 40  # the heartbeat, not the survivor's collective timeout (60 s)
    pid = int((tmp_path / "pid").read_text())
    assert process_gone(pid), pid  # killed, not left stopped
    assert _wait_until(_all_cpus_free), ray.available_resources()
    with pytest.raises(ConfigError, match=r"RayLauncher: need 0 < heartbeat_s < heartbeat_timeout_s \(got 2, 1\)"):
        RayLauncher(heartbeat_s=2, heartbeat_timeout_s=1)

