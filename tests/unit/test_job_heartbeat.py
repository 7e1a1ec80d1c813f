"""The job file's heartbeat settings reach the launcher that runs the ranks, for restart and in-place recovery."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from helpers import TINY
from starverse.elastic.inplace import InplaceLauncher
from starverse.jobs import prepare_job
from starverse.providers.local import LocalLauncher


def _job(tmp_path: Path, extra: str) -> Path:
    (tmp_path / "tiny.json").write_text(json.dumps(TINY))
    (tmp_path / "corpus.txt").write_text(Path(os.__file__).read_text()[:4000])
    path = tmp_path / "job.yaml"
    path.write_text("model: tiny.json\ndataset: corpus.txt\nrun_dir: run\ndevices: {cpu_ranks: 2}\n"
                    "train: {steps: 2, seq_len: 32, global_batch: 4, micro_batch: 2}\nmetrics: {enabled: false}\n"
                    "billing: {enabled: false}\n" + extra)
    return path


@pytest.mark.parametrize("recovery", ["restart", "in-place"])
def test_heartbeat_settings_reach_the_launcher(tmp_path: Path, recovery: str) -> None:
    prepared = prepare_job(_job(tmp_path, f"recovery: {recovery}\nheartbeat_s: 0.5\nheartbeat_timeout_s: 7\n"))
    launcher = prepared.supervisor.launcher
    assert isinstance(launcher, InplaceLauncher if recovery == "in-place" else LocalLauncher)
    assert (launcher.heartbeat_s, launcher.heartbeat_timeout_s) == (0.5, 7.0)
    if isinstance(launcher, InplaceLauncher):  # its checkpoint-restart fallback watches the same way
        restart = launcher.restart_launcher()
        assert (restart.heartbeat_s, restart.heartbeat_timeout_s) == (0.5, 7.0)


def test_default_heartbeat(tmp_path: Path) -> None:
    launcher = prepare_job(_job(tmp_path, "")).supervisor.launcher
    assert isinstance(launcher, LocalLauncher)
    assert (launcher.heartbeat_s, launcher.heartbeat_timeout_s) == (1.0, 60.0)
