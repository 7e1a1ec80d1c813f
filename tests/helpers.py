"""Pieces several test modules share: a tiny trainable LM and its data, the CLI and a tiny llama config.

Importable as ``helpers`` (``tests/`` is on ``sys.path`` through its conftest), also in rank processes: the
local launcher's spawned ranks and the Ray provider's actors inherit the caller's ``sys.path``.
"""

from __future__ import annotations

import copy
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from starverse.runtime.callbacks import Callback

VOCAB, SEQ = 48, 16
"""Vocabulary of :class:`TinyLM` and the sequence length :func:`ramp_tokens` is sized for."""

RAY_GROUP = "ray"
"""The ``xdist_group`` of every test that starts or joins a Ray cluster (``pytest.mark.xdist_group(RAY_GROUP)`` on
its module or on it): under ``pytest -n N --dist loadgroup`` they all run in one worker, one after another, so no two
Ray clusters (Ray's fixed default ports, its ``/tmp/ray`` session records) are ever up at once."""

CLI = [str(Path(sys.executable).parent / "starverse")]
"""The ``starverse`` command of this environment."""

TINY = {
    "model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
    "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 320, "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "hidden_act": "silu",
}
"""A one-layer llama config.json that trains in seconds on CPU ranks."""


class SleepyRank(Callback):
    """Rank ``rank`` takes ``seconds`` longer per micro-batch: far above scheduling noise on a busy machine, so
    the rebalance this test needs happens for sure (``starverse.testing.SlowRank`` scales a few ms instead)."""

    def __init__(self, rank: int, seconds: float):
        self.rank, self.seconds = rank, seconds

    def on_micro_batch_end(self, ctx, compute_s):
        if ctx.rank == self.rank:
            time.sleep(self.seconds)


def with_adapters(model: torch.nn.Module, rank: int) -> torch.nn.Module:
    """``model`` with LoRA adapters of ``rank`` (in place), initialised from fixed seeds whatever the global
    generator's state. ``lora_B`` starts non-zero (peft starts it at 0), so both adapter matrices learn from the
    first step and ``lora_A``'s gradients are not ~0, where Adam's normalisation turns fp32 summation-order
    noise into lr-sized differences."""
    from starverse.runtime.lora import apply_lora

    with torch.random.fork_rng():
        torch.manual_seed(1)
        apply_lora(model, rank)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0.0, 0.1, generator=g)
    return model


class TinyLM(torch.nn.Module):
    """Embedding -> 2-layer MLP with LayerNorm -> logits (a plain module: the trainer computes the loss)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 32)
        self.norm = torch.nn.LayerNorm(32)
        self.fc1 = torch.nn.Linear(32, 64)
        self.fc2 = torch.nn.Linear(64, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits for token ids."""
        return self.fc2(torch.tanh(self.fc1(self.norm(self.emb(ids)))))


def ramp_tokens() -> list[torch.Tensor]:
    """Documents with structure (repeating ramps) so the loss moves; 40 sequences' worth."""
    g = torch.Generator().manual_seed(7)
    return [(torch.arange(SEQ * 4) * (i + 1) + torch.randint(0, 3, (SEQ * 4,), generator=g)) % VOCAB for i in range(10)]


def new_user_env(tmp: Path) -> dict[str, str]:
    """The environment of a new user under ``tmp``: no probe profile, no user ledger, no catalog override."""
    env = dict(os.environ)
    env.update(STARVERSE_CACHE=str(tmp / "cache"), HOME=str(tmp), COLUMNS="200")
    for k in ("STARVERSE_CATALOG", "STARVERSE_PROFILE", "STARVERSE_LEDGER", "XDG_DATA_HOME"):
        env.pop(k, None)
    return env


CORPUS = "the quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat. " * 60
"""A small repetitive corpus a tiny model learns quickly."""


def save_tiny_pretrained(folder: Path, text: str = CORPUS, *, vocab: int = 300, layers: int = 2, seed: int = 0):
    """A tiny Llama with its own BPE tokenizer, written with ``save_pretrained`` (no downloads); returns the model.

    The tokenizer is trained on ``text`` with at most ``vocab`` ids; the model's vocabulary is exactly its size.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([text], trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    hf_tok.save_pretrained(folder)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=2,
                      num_key_value_heads=2, vocab_size=len(hf_tok), max_position_embeddings=128,
                      tie_word_embeddings=False, eos_token_id=hf_tok.eos_token_id, bos_token_id=hf_tok.eos_token_id)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(folder)
    return model


def reference_training(
    model: torch.nn.Module, trainer: Any, data: Any, steps: int, global_batch: int,
    loss_of: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor],
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain single-process training of a copy of ``model``: ``steps`` global batches of ``data`` (a
    ``PackedDataset``) in the trainer's sampler order, ``loss_of(model, x)`` on the whole batch, clipping,
    AdamW and the schedule from the trainer's settings. Returns the losses and the final state dict."""
    from starverse.runtime.data import DeterministicSampler
    from starverse.runtime.steps import make_optimizer, make_schedule

    model = copy.deepcopy(model)
    sampler = DeterministicSampler(len(data), seed=trainer.seed)
    opt = make_optimizer(model, trainer.lr, trainer.weight_decay, eps=trainer.adam_eps)
    sched = make_schedule(opt, trainer.warmup_steps or 1, steps, trainer.min_lr_ratio)
    losses = []
    for _ in range(steps):
        x = torch.from_numpy(data.batch(sampler.next_indices(global_batch)))
        loss = loss_of(model, x)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), trainer.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, model.state_dict()


def process_gone(pid: int, wait_s: float = 15.0) -> bool:
    """Whether process ``pid`` stops running within ``wait_s`` (gone, or a zombie its parent has not reaped yet)."""
    end = time.monotonic() + wait_s
    while True:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except FileNotFoundError:
            return True
        if time.monotonic() > end:
            return False
        time.sleep(0.1)


def assert_same_as_one_process(res: Any, model: torch.nn.Module, initial: torch.nn.Module, trainer: Any, steps: int,
                               global_batch: int) -> None:
    """The fit's losses and ``model``'s final weights equal one process's training of ``initial`` on the same global
    batches of :func:`ramp_tokens` (``assert_close``)."""
    import numpy as np

    from starverse.runtime.data import PackedDataset
    from starverse.runtime.steps import batch_loss

    tokens = np.concatenate([t.numpy() for t in ramp_tokens()]).astype(np.int32)
    ref_losses, ref_state = reference_training(initial, trainer, PackedDataset(tokens, SEQ), steps, global_batch,
                                               batch_loss)
    torch.testing.assert_close(torch.tensor(res.losses), torch.tensor(ref_losses))
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, ref_state[name], msg=name)


def forward_activation_bytes(model: torch.nn.Module, x: torch.Tensor) -> tuple[int, torch.Tensor]:
    """Bytes of activations alive after ``model``'s forward on ``x`` (torch's MemTracker, CPU) and its loss."""
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        loss = model(input_ids=x, labels=x).loss
        snapshot = tracker.get_tracker_snapshot("current")
    return snapshot[torch.device("cpu")][_MemRefType.ACT], loss


def estimated_memory_bytes(cfg: dict, seq: int, batch: int, recompute: str, tp: int = 1,
                           sequence_parallel: bool = False) -> float:
    """The estimate's memory need, in bytes, of one fp32 CPU replica of ``cfg`` (all its layers on one stage)
    training ``batch`` sequences of ``seq`` tokens in one micro-batch."""
    from starverse.catalog import load_catalog
    from starverse.config import parse
    from starverse.costmodel.step import estimate
    from starverse.models.families import spec_from_config
    from starverse.plan import Plan

    spec = spec_from_config(cfg, "cfg", "tiny")
    plan = parse(Plan, {"model": "tiny", "train": {"seq_len": seq, "global_batch": batch, "precision": "fp32",
                                                   "recompute": recompute, "sequence_parallel": sequence_parallel},
                        "groups": [{"replicas": 1, "micro_batch": batch, "stages": [
                            {"accelerator": "cpu", "tp": tp, "layers": spec.num_layers}]}]}, "test.yaml")
    return estimate(plan, load_catalog(), spec).memory_gb * 1e9


def load_script(path: Path, name: str) -> Any:
    """Import the script (or benchmark module) at ``path`` as module ``name``, registered in ``sys.modules`` (its
    dataclasses and forked workers look their module up by name)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
