"""Preemption notice sources (signal, file, cloud metadata endpoint on 127.0.0.1) and the insurance callbacks
in one process: a notice stops training at a step boundary with an emergency checkpoint; the automatic
interval is chosen from the measured save cost and logged with its reason."""

from __future__ import annotations

import http.server
import logging
import math
import os
import signal
import threading
from pathlib import Path

import pytest
import torch

from starverse.checkpoint import CheckpointCallback, CheckpointStore
from starverse.elastic.notice import (
    FileNotice,
    HttpNotice,
    NoticeWatcher,
    SignalNotice,
    aws_spot_notice,
    gcp_preemption_notice,
)
from starverse.elastic.preemption import PreemptionCallback
from starverse.plan import Group, Plan, Stage, TrainSpec
from starverse.runtime.callbacks import TrainContext

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def test_sigterm_becomes_a_notice_and_the_handler_is_restored():
    src = SignalNotice()
    src.start()
    try:
        assert src.poll() is None
        os.kill(os.getpid(), signal.SIGTERM)
        notice = src.poll()
        assert notice is not None and notice.source == "SIGTERM"
    finally:
        src.stop()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_file_notice_and_watcher_keep_the_first(tmp_path):
    a, b = FileNotice(tmp_path / "a"), FileNotice(tmp_path / "b")
    w = NoticeWatcher([a, b])
    w.start()
    assert w.poll() is None
    (tmp_path / "b").write_text("instance-action: terminate\n")
    first = w.poll()
    (tmp_path / "a").write_text("later")
    assert w.poll() is first and first.source == str(tmp_path / "b") and first.detail == "instance-action: terminate"


class _Metadata(http.server.BaseHTTPRequestHandler):
    """A fake cloud metadata server: AWS's spot/instance-action and GCP's instance/preempted."""

    preempted = False

    def do_GET(self):
        if self.path.endswith("/spot/instance-action"):
            code, body = (200, '{"action": "terminate"}') if self.preempted else (404, "")
        elif self.path.endswith("/instance/preempted"):
            ok = self.headers.get("Metadata-Flavor") == "Google"
            code, body = (200, "TRUE" if self.preempted else "FALSE") if ok else (403, "")
        else:
            code, body = 404, ""
        self.send_response(code)
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args):
        pass


@pytest.fixture
def metadata_server():
    _Metadata.preempted = False
    server = http.server.HTTPServer(("127.0.0.1", 0), _Metadata)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_cloud_metadata_endpoints(metadata_server, caplog):
    aws = aws_spot_notice(metadata_server)
    gcp = gcp_preemption_notice(metadata_server)
    assert aws.check_once() is None and gcp.check_once() is None
    _Metadata.preempted = True
    assert aws.check_once().detail == '{"action": "terminate"}'
    assert gcp.check_once().detail == "TRUE"
    # The polling thread picks it up by itself.
    poller = aws_spot_notice(metadata_server, interval_s=0.01)
    poller.start()
    for _ in range(500):
        if poller.poll() is not None:
            break
        threading.Event().wait(0.01)
    poller.stop()
    assert poller.poll() is not None
    dead = HttpNotice("http://127.0.0.1:9/none", lambda s, b: s == 200, timeout_s=0.2)
    with caplog.at_level(logging.WARNING):
        assert dead.check_once() is None and dead.check_once() is None
    assert sum("unreachable" in r.message for r in caplog.records) == 1


def _ctx(tmp_path: Path, max_steps: int = 50) -> TrainContext:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    plan = Plan(model="tiny", train=TrainSpec(seq_len=8, global_batch=4),
                groups=[Group(stages=[Stage(accelerator="cpu", layers=1)])])
    return TrainContext(rank=0, world_size=1, plan=plan, run_dir=tmp_path, step=0, model=model, optimizer=opt,
                        lr_scheduler=sched, sampler=None, group=None, device_kind="cpu", max_steps=max_steps,
                        shares=[4])


def _train_step(ctx: TrainContext) -> None:
    x = torch.randn(8, 16)
    ctx.optimizer.zero_grad()
    loss = ctx.model(x).pow(2).mean()
    loss.backward()
    ctx.optimizer.step()
    ctx.lr_scheduler.step()
    ctx.step += 1
    ctx.metrics.loss = loss.item()
    ctx.metrics.step_time_s = 0.5  # as if a step took 0.5 s: the interval is computed in steps of it


def _fit(ctx: TrainContext, callbacks, steps: int, on_step=None) -> None:
    for cb in callbacks:
        cb.on_fit_start(ctx)
    for _ in range(steps):
        _train_step(ctx)
        if on_step:
            on_step(ctx)
        for cb in callbacks:
            cb.on_step_end(ctx)
        if ctx.stop_reason:
            break
    for cb in callbacks:
        cb.on_fit_end(ctx)


def test_notice_stops_at_the_step_boundary_with_an_emergency_checkpoint(tmp_path):
    ctx = _ctx(tmp_path)
    flag = tmp_path / "preempt-me"
    ck = CheckpointCallback(interval_steps=10)
    cbs = [PreemptionCallback([FileNotice(flag)], grace_s=5), ck]
    _fit(ctx, cbs, steps=50, on_step=lambda c: c.step == 7 and flag.touch())
    assert ctx.step == 7 and ctx.stop_reason.startswith(f"preempted ({flag})")
    assert ctx.notice is not None and ctx.notice.source == str(flag)
    store = CheckpointStore(tmp_path / "checkpoints")
    assert [(i.step, i.reason) for i in store.list()] == [(7, "notice")]
    assert ctx.committed is not None and (ctx.committed.step, ctx.committed.reason) == (7, "notice")
    expected = {k: v.clone() for k, v in ctx.model.state_dict().items()}
    # Resume in a fresh context: step, LR schedule and weights continue where the notice stopped.
    ctx2 = _ctx(tmp_path)
    ck2 = CheckpointCallback(resume_from="latest")
    ck2.on_fit_start(ctx2)
    assert ctx2.step == 7 and ck2.resumed is not None and ck2.resumed.info.step == 7
    assert ctx2.lr_scheduler.last_epoch == 7 and ctx2.optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 / 8)
    for k, v in ctx2.model.state_dict().items():
        assert torch.equal(v, expected[k])


def test_automatic_interval_from_measured_save_cost_is_logged_with_its_reason(tmp_path, caplog):
    ctx = _ctx(tmp_path, max_steps=40)
    ck = CheckpointCallback(mtbf_s=600.0, keep_last=None)
    with caplog.at_level(logging.INFO, logger="starverse.checkpoint.callback"):
        _fit(ctx, [ck], steps=40)
    choice = ck.choice
    # First save after step 1 measures the cost; then Young/Daly: sqrt(2·C·600 s) in 0.5 s steps.
    assert choice.save_cost_s is not None and choice.save_cost_s >= 0 and choice.mtbf_s == 600.0
    tau = max(math.sqrt(2 * choice.save_cost_s * 600.0), choice.write_s)
    assert abs(choice.steps - tau / 0.5) <= 1 + 0.1 * tau / 0.5
    logged = [r.message for r in caplog.records if r.message.startswith("checkpoint interval: every")]
    assert logged and "Young/Daly" in logged[-1] and "MTBF=10 min" in logged[-1]
    steps = [i.step for i in CheckpointStore(tmp_path / "checkpoints").list()]
    assert steps[0] == 1 and steps[-1] == 40
    info = CheckpointStore(tmp_path / "checkpoints").get(40)
    assert info.reason == "final" and "Young/Daly" in info.manifest["interval"]["reason"]
    # What the billing and metrics callbacks read: the last committed checkpoint.
    published = ctx.committed
    assert published is not None
    assert published.step == 40 and published.reason == "final" and published.path == str(info.path)
    assert abs(published.at_s - info.path.stat().st_mtime) < 120 and published.seconds > 0
