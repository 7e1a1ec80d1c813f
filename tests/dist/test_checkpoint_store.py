"""The checkpoint store and the per-rank Checkpointer in one process: exact resume, async snapshots,
atomic commit, retention, rollback, and the errors for missing, foreign, torn and corrupted checkpoints."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from starverse.checkpoint import Checkpointer, CheckpointStore
from starverse.checkpoint.store import MANIFEST_NAME
from starverse.errors import CheckpointError


def _model(seed: int = 0, width: int = 16) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.Tanh(), torch.nn.Linear(width, 2))
    o = torch.optim.AdamW(m.parameters(), lr=0.05)
    s = torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5)
    return m, o, s


def _step(m, o, s) -> float:
    # Data from the global RNG: a resume that forgot the RNG state would see different batches.
    x = torch.randn(4, 8)
    o.zero_grad()
    loss = m(x).pow(2).mean()
    loss.backward()
    o.step()
    s.step()
    return loss.item()


def _tree_hash(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_resume_equals_uninterrupted_step_for_step(tmp_path):
    m, o, s = _model()
    store = CheckpointStore(tmp_path)
    ck = Checkpointer(store)
    for _ in range(3):
        _step(m, o, s)
    ck.save(3, m, o, extras={"lr_scheduler": s.state_dict()})
    ck.wait()
    reference = [_step(m, o, s) for _ in range(4)]

    # A fresh process state: other init, other RNG position, other LR.
    m2, o2, s2 = _model(seed=123)
    torch.manual_seed(999)
    loaded = Checkpointer(store).load(store.get(3), m2, o2)
    s2.load_state_dict(loaded.extras["lr_scheduler"])
    assert loaded.extras["step"] == 3 and not loaded.resharded
    resumed = [_step(m2, o2, s2) for _ in range(4)]
    assert resumed == reference
    for a, b in zip(m.parameters(), m2.parameters(), strict=True):
        assert torch.equal(a, b)


def test_async_save_captures_the_step_even_when_training_continues(tmp_path):
    m, o, s = _model()
    store = CheckpointStore(tmp_path)
    ck = Checkpointer(store, async_save=True)
    _step(m, o, s)
    expected = {k: v.clone() for k, v in m.state_dict().items()}
    expected_avg = o.state[m[0].weight]["exp_avg"].clone()
    ck.save(1, m, o)
    for _ in range(3):  # the optimizer pre-hook waits for the snapshot before changing weights
        _step(m, o, s)
    info = ck.wait()
    assert info is not None and info.step == 1
    m2, o2, _ = _model(seed=5)
    Checkpointer(store).load(info, m2, o2)
    for k, v in m2.state_dict().items():
        assert torch.equal(v, expected[k]), k
    assert torch.equal(o2.state[m2[0].weight]["exp_avg"], expected_avg)
    assert not torch.equal(m2[0].weight, m[0].weight)  # the live model did move on
    assert ck.stats.num_saves == 1 and ck.stats.blocked_s >= 0


def test_keep_last_and_snapshots(tmp_path):
    m, o, s = _model()
    store = CheckpointStore(tmp_path, keep_last=2, keep_every=4)
    ck = Checkpointer(store)
    for step in range(1, 10):
        _step(m, o, s)
        ck.save(step, m, o)
    ck.wait()
    assert [i.step for i in store.list()] == [4, 8, 9]
    assert store.latest().step == 9
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())


def test_manifest_records_plan_billing_cursor_and_checksums(tmp_path):
    m, o, _ = _model()
    store = CheckpointStore(tmp_path)
    ck = Checkpointer(store, device_kind="rtx-4090")
    info = ck.save(7, m, o, manifest={"plan": "model: x\n", "billing_cursor": {"ledger_seq": 42}}, blocking=True)
    assert info.step == 7 and info.device_kinds == ("rtx-4090",) and info.world_size == 1
    assert info.billing_cursor == {"ledger_seq": 42} and info.plan_yaml == "model: x\n"
    assert info.num_params == sum(p.numel() for p in m.parameters())
    files = json.loads((tmp_path / "step-7" / MANIFEST_NAME).read_text())["files"]
    assert {".metadata", "extras.pt", "rng-0.pt"} <= set(files)
    assert info.size_bytes == sum(f["bytes"] for f in files.values()) > 0


def test_rollback_sets_newer_checkpoints_aside_and_never_overwrites(tmp_path):
    m, o, s = _model()
    store = CheckpointStore(tmp_path, keep_last=None)
    ck = Checkpointer(store)
    for step in (2, 4, 6):
        _step(m, o, s)
        ck.save(step, m, o, blocking=True)
    before = _tree_hash(tmp_path / "step-6")
    with pytest.raises(CheckpointError, match=r"step-6: already exists; refusing to overwrite"):
        ck.save(6, m, o, blocking=True)
    assert _tree_hash(tmp_path / "step-6") == before
    aside = store.set_aside_after(2)
    assert [i.step for i in store.list()] == [2]
    assert sorted(p.name for p in aside.iterdir()) == ["step-4", "step-6"]
    assert _tree_hash(aside / "step-6") == before


def _errors_for(path: Path, step: int | None = None) -> str:
    store = CheckpointStore(path)
    m, o, _ = _model()
    with pytest.raises(CheckpointError) as e:
        info = store.get(step) if step is not None else (store.require_any() or store.latest())
        Checkpointer(store).load(info, m, o)
    return str(e.value)


def test_missing_empty_and_foreign_directories_give_one_clear_error(tmp_path):
    assert "no such checkpoint directory" in _errors_for(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    assert "no complete checkpoint to resume from: it is empty" in _errors_for(tmp_path / "empty")
    foreign = tmp_path / "foreign"
    (foreign / "step-3").mkdir(parents=True)
    (foreign / "step-3" / "model.bin").write_bytes(b"x" * 10)
    assert "not a Starverse checkpoint" in _errors_for(foreign, 3)
    (foreign / "weights.safetensors").write_bytes(b"y")
    msg = _errors_for(foreign)
    assert "no complete checkpoint to resume from: its step folders have no valid Starverse manifest" in msg
    other = tmp_path / "other"
    (other / "step-1").mkdir(parents=True)
    (other / "step-1" / MANIFEST_NAME).write_text(json.dumps({"format": "orbax", "step": 1}))
    assert "foreign manifest (format 'orbax'" in _errors_for(other, 1)


def test_a_checkpoint_of_another_model_is_refused_without_touching_it(tmp_path):
    m, o, _ = _model(width=32)
    store = CheckpointStore(tmp_path)
    Checkpointer(store).save(1, m, o, blocking=True)
    before = _tree_hash(tmp_path)
    msg = _errors_for(tmp_path, 1)
    assert "written for a different model" in msg and "with the model it was written for" in msg
    assert _tree_hash(tmp_path) == before


def test_corrupted_checkpoint_is_detected_and_left_alone(tmp_path):
    m, o, _ = _model()
    store = CheckpointStore(tmp_path)
    Checkpointer(store).save(1, m, o, blocking=True)
    data = next((tmp_path / "step-1").glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    before = _tree_hash(tmp_path)
    assert "checksum mismatch (corrupted checkpoint)" in _errors_for(tmp_path, 1)
    data.write_bytes(bytes(raw[:-10]))
    assert "differs from the manifest's" in _errors_for(tmp_path, 1)
    (tmp_path / "step-1" / MANIFEST_NAME).write_text("{not json")
    assert "corrupted manifest (JSONDecodeError)" in _errors_for(tmp_path, 1)
    assert _tree_hash(tmp_path).keys() == before.keys()


def test_unknown_step_lists_the_available_ones(tmp_path):
    m, o, _ = _model()
    store = CheckpointStore(tmp_path)
    for step in (3, 6):
        Checkpointer(store).save(step, m, o, blocking=True)
    assert "no checkpoint for step 5; complete checkpoints: 3, 6" in _errors_for(tmp_path, 5)


_KILL_DURING_WRITE = textwrap.dedent(
    """
    import os, signal, sys, torch
    from torch.distributed.checkpoint import FileSystemWriter
    from starverse.checkpoint import Checkpointer, CheckpointStore

    class DiesMidWrite(FileSystemWriter):
        def write_data(self, plan, planner):
            fut = super().write_data(plan, planner)
            fut.wait()
            os.kill(os.getpid(), signal.SIGKILL)   # data on disk, metadata and manifest not yet
            return fut

    torch.manual_seed(0)
    m = torch.nn.Linear(8, 8); o = torch.optim.AdamW(m.parameters())
    store = CheckpointStore(sys.argv[1])
    Checkpointer(store).save(1, m, o, blocking=True)
    m.weight.data.add_(1.0)
    Checkpointer(store, writer_factory=DiesMidWrite).save(2, m, o, blocking=True)
    """
)


def test_kill_during_a_checkpoint_write_falls_back_to_the_previous_one(tmp_path):
    proc = subprocess.run([sys.executable, "-c", _KILL_DURING_WRITE, str(tmp_path)], timeout=120)
    assert proc.returncode == -9
    store = CheckpointStore(tmp_path)
    assert [i.step for i in store.list()] == [1]
    (torn,) = store.partials()
    assert torn.name.startswith(".partial-step-2-") and any(torn.glob("*.distcp"))
    torch.manual_seed(0)
    expected = torch.nn.Linear(8, 8).weight.detach().clone()
    m = torch.nn.Linear(8, 8)
    Checkpointer(store).load(store.latest(), m, torch.optim.AdamW(m.parameters()))
    assert torch.equal(m.weight, expected)
    assert store.clean_partials() == 1 and store.partials() == []


def test_a_failed_background_save_surfaces_at_the_next_save(tmp_path):
    m, o, _ = _model()
    blocker = tmp_path / "ckpt"
    blocker.write_text("a file where the checkpoint folder should be")
    ck = Checkpointer(CheckpointStore(blocker))
    ck.save(1, m, o)
    with pytest.raises(CheckpointError, match=r"checkpoint failed: .*previous complete checkpoint is untouched"):
        ck.save(2, m, o)
    assert os.path.isfile(blocker)
