"""Service figures (issue 12); prints ONE JSON object.

- Load: ``--clients`` (default 50) concurrent HTTP clients on 127.0.0.1 for at most ``--seconds`` (30) and
  at most ``--max-requests`` each: most ask a job's status, ``--plan-clients`` (5) ask for the quickstart
  plan (examples/quickstart job + pool). ``status_p99_ms`` (target <= 50), ``plan_p99_s`` (target <= 2) and
  ``errors`` (target 0), beside the same calls made in-process in the same run (``status_inprocess_p99_ms``,
  ``plan_inprocess_p99_s``) and their ratios (``status_overhead_ratio``, ``plan_overhead_ratio``): what HTTP,
  auth and the server add. The clients run in a separate process (``service_loadgen.py``: asyncio, raw
  keep-alive connections) so the figures are the server's, not a thread-per-client generator's. The server
  runs as shipped: the plan cache answers the repeated quickstart request after its first search; a second
  phase of ``--uncached-seconds`` (15) with ``serve --plan-cache 0`` gives the ``uncached_*`` figures, where
  every plan request is a search (5 clients queue on one planner process, so its p99 is ~5 searches).
  ``server_cpu_ms_per_request`` (the server process's CPU time over the phase / requests answered) and the
  machine's 1-minute load average before and after say how much of a latency is the server's own work and
  how much is waiting for a CPU on a shared machine.
- Restart: the server is SIGKILLed while 3 jobs run and 2 wait, then started again: ``jobs_lost`` (jobs that
  did not finish; target 0), ``jobs_run_twice`` (a second fresh start, or two launches of one job alive at
  once; target 0) and ``recovered_s`` (kill -> every job that was running has been relaunched by the new
  server, resuming from its checkpoint: old runners' emergency checkpoints, server start, recovery, claim).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
TINY = {
    "model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
    "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 320, "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "hidden_act": "silu",
}


def p99(xs: list[float]) -> float | None:
    """The 99th percentile (nearest rank)."""
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(0.99 * len(s)))]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def setup(root: Path) -> tuple[Any, str]:
    """A service root with the tiny model and a corpus registered and one tenant; returns (settings, token)."""
    from starverse.service.db import Database, migrate
    from starverse.service.settings import ServiceSettings
    from starverse.service.storage import register_platform
    from starverse.service.tenants import create_tenant, create_token

    settings = ServiceSettings(root=root, signup_credit=__import__("decimal").Decimal(1000))
    root.mkdir(parents=True, exist_ok=True)
    (root.parent / "tiny.json").write_text(json.dumps(TINY))
    (root.parent / "corpus.txt").write_text((REPO / "README.md").read_text() * 2)
    register_platform(settings, "models", "tiny", root.parent / "tiny.json")
    register_platform(settings, "datasets", "corpus", root.parent / "corpus.txt")
    migrate(settings.url)
    db = Database(settings.url)
    create_tenant(db, settings, "bench")
    token = create_token(db, "bench")
    db.dispose()
    return settings, token


def start_server(root: Path, port: int, slots: int, extra: list[str] | None = None) -> subprocess.Popen[bytes]:
    cmd = [str(Path(sys.executable).parent / "starverse"), "serve", "--root", str(root), "--port", str(port),
           "--slots", str(slots), *(extra or [])]
    log = (root / f"serve-{time.time():.0f}.log").open("wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/api/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server did not start within 120 s")


def job(steps: int, interval: int) -> dict[str, Any]:
    return {"model": "tiny", "dataset": "corpus",
            "train": {"steps": steps, "seq_len": 16, "global_batch": 2, "micro_batch": 2, "rebalance_every": 0},
            "checkpoint": {"interval_steps": interval, "async_save": False},
            "pool": {"currency": "USD", "offers": [{"accelerator": "cpu", "count": 8, "price_per_hour": 0.4}]}}


def quickstart() -> dict[str, Any]:
    return {"job_yaml": (REPO / "examples/quickstart/job.yaml").read_text(),
            "pool_yaml": (REPO / "examples/quickstart/pool.yaml").read_text(), "top": 5}


def load_phase(settings: Any, token: str, tmp: Path, *, seconds: float, plan_cache: int,
               args: argparse.Namespace) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """One server (no worker: the status of a queued job) under the load generator for ``seconds``; returns
    the job id, the request body of the plans and the generator's result."""
    port = free_port()
    server = start_server(settings.root, port, slots=0, extra=["--plan-cache", str(plan_cache)])
    base = f"http://127.0.0.1:{port}"
    headers = {"Authorization": f"Bearer {token}"}
    try:
        jid = httpx.post(f"{base}/api/jobs", headers=headers, json={"job": job(5, 5)}, timeout=60).json()["id"]
        body = quickstart()
        httpx.post(f"{base}/api/plan", headers=headers, json=body, timeout=120)  # warm the catalog and planner
        spec = {"host": "127.0.0.1", "port": port, "token": token, "job_id": jid, "plan_body": body,
                "clients": args.clients, "plan_clients": args.plan_clients, "seconds": seconds,
                "max_requests": args.max_requests}
        spec_path = tmp / f"loadgen-{plan_cache}.json"
        spec_path.write_text(json.dumps(spec))
        load0, cpu0 = os.getloadavg()[0], cpu_seconds(server.pid)
        gen = subprocess.run([sys.executable, str(Path(__file__).with_name("service_loadgen.py")), str(spec_path)],
                             capture_output=True, text=True, timeout=seconds + 300)
        if gen.returncode != 0:
            raise RuntimeError(f"load generator failed: {gen.stderr[-2000:]}")
        res: dict[str, Any] = json.loads(gen.stdout)
        # the server's own CPU time per request: what it costs, whatever else the machine is running
        n = len(res["status_s"]) + len(res["plan_s"])
        res["server_cpu_ms_per_request"] = round((cpu_seconds(server.pid) - cpu0) * 1e3 / max(1, n), 3)
        res["load_average_1min"] = [round(load0, 2), round(os.getloadavg()[0], 2)]
        return jid, body, res
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)


def figures(res: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """p99 and median of the status (ms) and plan (s) latencies of one load phase."""
    status_ms = [x * 1e3 for x in res["status_s"]]
    plan_s: list[float] = res["plan_s"]
    sp, pp = p99(status_ms), p99(plan_s)
    return {f"{prefix}status_requests": len(status_ms), f"{prefix}plan_requests": len(plan_s),
            f"{prefix}errors": res["errors"], f"{prefix}error_samples": res["failures"],
            f"{prefix}status_p99_ms": None if sp is None else round(sp, 2),
            f"{prefix}status_median_ms": round(statistics.median(status_ms), 2) if status_ms else None,
            f"{prefix}plan_p99_s": None if pp is None else round(pp, 3),
            f"{prefix}plan_median_s": round(statistics.median(plan_s), 3) if plan_s else None,
            f"{prefix}server_cpu_ms_per_request": res["server_cpu_ms_per_request"],
            f"{prefix}load_average_1min": res["load_average_1min"]}


def bench_load(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    settings, token = setup(tmp / "load" / "root")
    jid, body, res = load_phase(settings, token, tmp, seconds=args.seconds, plan_cache=256, args=args)
    out: dict[str, Any] = {
        "load_generator": "its own process (benchmarks/service_loadgen.py): one asyncio loop, one raw HTTP/1.1 "
                          "keep-alive connection per client, closed loop without think time",
        "clients": args.clients, "plan_clients": args.plan_clients, "load_wall_s": round(res["wall_s"], 2),
        **figures(res)}
    if args.uncached_seconds > 0:
        # the same load with the plan cache off: every plan request is a search in the planner process
        _, _, res = load_phase(settings, token, tmp, seconds=args.uncached_seconds, plan_cache=0, args=args)
        out.update({"uncached_load_wall_s": round(res["wall_s"], 2), **figures(res, "uncached_")})
    inproc = bench_inprocess(settings, jid, body, n_status=200, n_plan=5)
    sp, pp = out["status_p99_ms"], out["plan_p99_s"]
    out.update({**inproc,
                "status_overhead_ratio": round(sp / inproc["status_inprocess_p99_ms"], 2) if sp else None,
                "plan_overhead_ratio": round(pp / inproc["plan_inprocess_p99_s"], 2) if pp else None})
    return out


def bench_inprocess(settings: Any, jid: str, body: dict[str, Any], n_status: int, n_plan: int) -> dict[str, Any]:
    """The same calls without HTTP: the job row lookup and the planner search, one at a time."""
    from sqlalchemy import select

    from starverse.catalog import load_catalog
    from starverse.planner import load_job, load_pool, search
    from starverse.service.db import Database, Job, Tenant
    from starverse.service.jobs import get_job, job_summary

    db = Database(settings.url)
    status = []
    with db.session() as s:
        tenant = s.scalar(select(Tenant))
    for _ in range(n_status):
        t0 = time.perf_counter()
        with db.session() as s:
            job_row: Job | None = get_job(s, tenant, jid)  # type: ignore[arg-type]
            assert job_row is not None
            job_summary(job_row)
        status.append((time.perf_counter() - t0) * 1e3)
    db.dispose()
    plan = []
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "job.yaml").write_text(body["job_yaml"])
        (Path(d) / "pool.yaml").write_text(body["pool_yaml"])
        for _ in range(n_plan):
            t0 = time.perf_counter()
            cat = load_catalog()
            search(load_job(Path(d) / "job.yaml"), load_pool(Path(d) / "pool.yaml", cat), cat, top=5)
            plan.append(time.perf_counter() - t0)
    return {"status_inprocess_p99_ms": round(p99(status) or 0, 3), "plan_inprocess_p99_s": round(p99(plan) or 0, 3)}


def bench_restart(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    settings, token = setup(tmp / "restart" / "root")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    headers = {"Authorization": f"Bearer {token}"}
    server = start_server(settings.root, port, slots=3)
    ids = [httpx.post(f"{base}/api/jobs", headers=headers, json={"name": f"r{i}", "job": job(args.steps, 3)},
                      timeout=60).json()["id"] for i in range(5)]

    def rows() -> list[dict[str, Any]]:
        return [httpx.get(f"{base}/api/jobs/{i}", headers=headers, timeout=60).json() for i in ids]

    try:
        deadline = time.monotonic() + 600
        while True:
            now = rows()
            running = [r for r in now if r["state"] == "running" and (r["last_step"] or 0) >= 4]
            if len(running) == 3 and sum(r["state"] == "queued" for r in now) == 2:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"jobs never reached 3 running + 2 queued: {now}")
            time.sleep(0.2)
        was_running = [r["id"] for r in running]
        os.kill(server.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        server.wait()
        server = start_server(settings.root, port, slots=3)
        recovered_s = None
        deadline = time.monotonic() + 1200
        while True:
            now = rows()
            if recovered_s is None and all(r["launches"] >= 2 for r in now if r["id"] in was_running):
                recovered_s = time.monotonic() - killed_at
            if all(r["state"] not in ("queued", "running") for r in now) or time.monotonic() > deadline:
                break
            time.sleep(0.3)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=120)
    from starverse.service.db import Database, Job

    db = Database(settings.url)
    twice = 0
    with db.session() as s:
        for jid in ids:
            row = s.get(Job, jid)
            assert row is not None
            folder = settings.tenant_dir(row.tenant_id) / "jobs" / jid
            runs = [json.loads(x) for x in (folder / "launches.jsonl").read_text().splitlines()]
            starts = [x["at"] for x in runs if x["event"] == "start"]
            ends = [x["at"] for x in runs if x["event"] == "end"]
            overlap = any(b < a for a, b in zip(ends, starts[1:], strict=False))
            twice += int(row.fresh_starts > 1 or overlap)
    db.dispose()
    return {"restart_jobs": 5, "restart_steps": args.steps,
            "jobs_lost": sum(r["state"] != "succeeded" or r["last_step"] != args.steps for r in now),
            "jobs_run_twice": twice, "recovered_s": None if recovered_s is None else round(recovered_s, 2),
            "relaunched": len(was_running)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument("--plan-clients", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--max-requests", type=int, default=2000, help="per client")
    ap.add_argument("--uncached-seconds", type=float, default=15.0,
                    help="a second load phase this long with the server's plan cache off (0: skip it)")
    ap.add_argument("--steps", type=int, default=30, help="steps of each restart-test job")
    ap.add_argument("--skip-restart", action="store_true")
    ap.add_argument("--skip-load", action="store_true")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-service-"))
    out: dict[str, Any] = {"bench": "service"}
    if not args.skip_load:
        out.update(bench_load(args, tmp))
    if not args.skip_restart:
        out.update(bench_restart(args, tmp))
    out["targets"] = {"status_p99_ms": 50, "plan_p99_s": 2, "errors": 0, "jobs_lost": 0, "jobs_run_twice": 0}
    json.dump(out, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
