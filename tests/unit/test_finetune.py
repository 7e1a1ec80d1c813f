"""Fine-tuning pieces in one process: pretrained folders (and their bad forms), model tokenizers, chat data with
masked labels, the exact masked loss, the held-out split, LoRA and its checkpoints, QLoRA's CPU error, export
with merged and unmerged adapters, and the runs log reader."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import starverse
from helpers import CORPUS, TinyLM, save_tiny_pretrained
from starverse.errors import ConfigError, ModelError
from starverse.metrics.runs import plot_loss_curves, read_run
from starverse.runtime.data import IGNORE_INDEX, load_tokenizer, pack, tokenize_corpus
from starverse.runtime.export import export_run, record_model
from starverse.runtime.lora import apply_lora, check_mode, trainable_state_dict
from starverse.runtime.steps import batch_loss


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    folder = tmp_path_factory.mktemp("tiny")
    return folder, save_tiny_pretrained(folder)


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_build_model_loads_single_and_sharded_safetensors_exactly(tiny, tmp_path):
    folder, saved = tiny
    built = starverse.build_model(str(folder))
    assert _same(built, saved) and built.config._name_or_path == str(folder.resolve())
    saved.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 2
    assert _same(starverse.build_model(tmp_path / "sharded"), saved)
    # dtype as asked, and a transformers model is taken as it is
    assert next(starverse.build_model(folder, dtype=torch.bfloat16).parameters()).dtype == torch.bfloat16
    assert starverse.build_model(saved) is saved


def test_a_folder_without_config_is_one_clear_error(tiny, tmp_path):
    shutil.copy(tiny[0] / "model.safetensors", tmp_path / "model.safetensors")
    with pytest.raises(ModelError, match=r"no config\.json, so this is not a Hugging Face model folder"):
        starverse.build_model(tmp_path)
    with pytest.raises(ModelError, match=r"no config\.json"):
        starverse.accelerate(model_id=str(tmp_path), num_cpu_ranks=1)


def _variant(src: Path, dst: Path, **changes: object) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_weights_that_do_not_match_the_config_are_an_error_never_a_random_init(tiny, tmp_path):
    folder = tiny[0]
    with pytest.raises(ModelError, match=r"weights do not match config\.json: .*shape\(s\) differ"):
        starverse.build_model(_variant(folder, tmp_path / "wide", hidden_size=64, intermediate_size=128))
    with pytest.raises(ModelError, match=r"weights do not match config\.json: .*not in the files .*layers\.2"):
        starverse.build_model(_variant(folder, tmp_path / "deep", num_hidden_layers=3))
    # weights saved under other names: the config says weights exist, none load
    from safetensors.torch import load_file, save_file

    renamed = _variant(folder, tmp_path / "renamed")
    sd = load_file(renamed / "model.safetensors")
    save_file({"transformer." + k: v for k, v in sd.items()}, renamed / "model.safetensors")
    with pytest.raises(ModelError, match="none of its tensors match the model"):
        starverse.build_model(renamed)
    junk = _variant(folder, tmp_path / "junk")
    (junk / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ModelError, match=r"junk/model\.safetensors: not a readable safetensors file"):
        starverse.build_model(junk)
    # an index naming a shard that is not there
    tiny[1].save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    next((tmp_path / "sharded").glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(ModelError, match=r"1 are missing \(model-00002"):
        starverse.build_model(tmp_path / "sharded")


def test_accelerate_keeps_a_pretrained_model_whole(tiny):
    folder, saved = tiny
    cluster = starverse.accelerate(model_id=str(folder), num_cpu_ranks=1, seq_len=32, global_batch=2, mode="lora",
                                   lora_rank=4)
    assert not cluster.scaled and cluster.plan.train.mode == "lora" and cluster.plan.train.lora_rank == 4
    model = starverse.build_model(cluster)
    base = {k: v for k, v in model.state_dict().items() if ".lora_" not in k}
    assert {k.replace(".base_layer", "") for k in base} == set(saved.state_dict())
    assert all(p.requires_grad == (".lora_" in n) for n, p in model.named_parameters())
    with pytest.raises(ModelError, match="a pretrained model is not scaled down"):
        starverse.accelerate(model_id=str(folder), num_cpu_ranks=1, max_params=1000)


def test_qlora_where_4bit_is_unavailable_is_one_clear_error(tiny):
    with pytest.raises(ConfigError, match=r"job\.yaml: train\.mode: qlora needs 4-bit base weights.*cpu.*mode: lora"):
        check_mode("qlora", ["cpu", "cpu"], "job.yaml")
    cluster = starverse.accelerate(model_id=str(tiny[0]), num_cpu_ranks=1, seq_len=32, global_batch=2, mode="qlora")
    with pytest.raises(ConfigError, match=r"train\.mode: qlora"):
        starverse.build_model(cluster)


def test_the_model_folder_tokenizer_is_used_and_its_vocabulary_checked(tiny, tmp_path):
    folder = tiny[0]
    text = tmp_path / "t.txt"
    text.write_text(CORPUS[:400])
    corpus = tokenize_corpus(text, tokenizer=str(folder))
    tok = load_tokenizer(folder).tok
    assert corpus.tokenizer == f"hf:{folder.resolve()}" and corpus.vocab_size == len(tok)
    assert corpus.tokens[:-1].tolist() == tok.encode(CORPUS[:400], add_special_tokens=False)
    assert corpus.tokens[-1] == tok.eos_token_id
    # a model whose vocabulary is smaller than the tokenizer's: one clear error, before any rank starts
    cfg = json.loads((folder / "config.json").read_text()) | {"vocab_size": 100}
    small = starverse.build_model(cfg)
    cluster = starverse.accelerate(model_id=cfg, num_cpu_ranks=1, seq_len=16, global_batch=2)
    trainer = starverse.Trainer(cluster, run_dir=tmp_path / "run", progress=False)
    with pytest.raises(ConfigError, match=r"has \d+ token ids but the model's vocabulary has 100: they do not belong"):
        trainer.fit(small, dataset=text, max_steps=1, tokenizer=str(folder))


def _decode(tok, ids):
    return tok.decode([int(i) for i in ids])


def test_instruction_data_trains_on_the_response_only(tiny, tmp_path):
    data = tmp_path / "chat.jsonl"
    rows = [{"prompt": "name a colour", "response": "blue"},
            {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                          {"role": "assistant", "content": "hello"}, {"role": "user", "content": "bye"},
                          {"role": "assistant", "content": "ciao"}]}]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    c = tokenize_corpus(data, tokenizer="bytes")
    trained = bytes(int(t) for t, m in zip(c.tokens, c.loss_mask, strict=True) if m and t < 256).decode()
    context = bytes(int(t) for t, m in zip(c.tokens, c.loss_mask, strict=True) if not m).decode()
    assert trained == "blue\nhello\nciao\n"
    assert context == "user: name a colour\nassistant: system: be brief\nuser: hi\nassistant: user: bye\nassistant: "
    # with a chat template: the template's text around the reply is context, the reply and its end are trained
    tok = load_tokenizer(tiny[0])
    tok.tok.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}")
    c2 = tokenize_corpus(data, tokenizer=tok)
    mask = c2.loss_mask.astype(bool)
    assert _decode(tok.tok, c2.tokens[mask]).replace("<|endoftext|>", "|") == "blue</s>|hello</s>ciao</s>|"
    assert "<assistant>" in _decode(tok.tok, c2.tokens[~mask])
    packed = pack(c2, 8)
    assert (packed.labels[~mask[: packed.labels.size]] == IGNORE_INDEX).all()
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": "x"}]}) + "\n")
    with pytest.raises(ConfigError, match=r"bad\.jsonl:1: 'messages' has no assistant turn"):
        tokenize_corpus(bad, tokenizer="bytes")


def test_masked_loss_over_uneven_micro_batches_is_the_global_token_mean():
    torch.manual_seed(0)
    model = TinyLM()
    x = torch.randint(0, 48, (6, 16))
    labels = x.clone()
    labels[torch.rand(x.shape) < 0.6] = IGNORE_INDEX
    labels[2] = IGNORE_INDEX  # a sequence with no targets at all
    n = int((labels[:, 1:] != IGNORE_INDEX).sum())
    logits = model(x)
    want = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 48), labels[:, 1:].reshape(-1),
                                             ignore_index=IGNORE_INDEX)
    parts = [batch_loss(model, x[a:b], labels=labels[a:b], num_targets=n) for a, b in ((0, 1), (1, 4), (4, 6))]
    torch.testing.assert_close(sum(parts), want)
    from starverse.runtime.data import PackedDataset

    ds = PackedDataset(x.reshape(-1).numpy(), 16, labels.reshape(-1).numpy())
    assert ds.num_targets(np.arange(6)) == n and ds.num_targets([2]) == 0


def test_held_out_split_is_the_tail_and_disjoint():
    c = tokenize_corpus([torch.arange(100)])
    train, held = pack(c, 10).split(3)
    assert len(train) == 7 and len(held) == 3
    assert held.batch([0])[0].tolist() == list(range(70, 80))
    with pytest.raises(ConfigError, match="cannot hold out 10 of 10"):
        pack(c, 10).split(10)


def test_lora_checkpoints_hold_only_adapters_and_export_merges_exactly(tiny, tmp_path):
    folder, _ = tiny
    model = starverse.build_model(folder)
    settings = apply_lora(model, 4)
    for n, p in model.named_parameters():  # as if trained: lora_B starts at zero
        if "lora_B" in n:
            p.data.normal_(0, 0.5)
    sd = trainable_state_dict(model)
    assert sd and all(".lora_" in k for k in sd)
    assert sum(v.numel() for v in sd.values()) < 0.1 * sum(p.numel() for p in model.parameters())
    run = tmp_path / "run"
    run.mkdir()
    record_model(run, model, tokenizer=load_tokenizer(folder).tok, lora=settings, mode="lora")
    torch.save(sd, run / "final_model.pt")
    x = torch.randint(0, 200, (2, 12))
    with torch.no_grad():
        want = model(x).logits
    merged = export_run(run, tmp_path / "merged", merge_lora=True)
    assert merged.merged and not merged.adapter_only and merged.has_tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert not any("lora" in k for k in loaded.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, want, rtol=1e-4, atol=1e-4)
    assert AutoTokenizer.from_pretrained(tmp_path / "merged").eos_token == "<|endoftext|>"
    adapter = export_run(run, tmp_path / "adapter")
    assert adapter.adapter_only and (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    from peft import PeftModel

    with torch.no_grad():
        peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder), tmp_path / "adapter")
        torch.testing.assert_close(peft_model(x).logits, want, rtol=1e-4, atol=1e-4)
    with pytest.raises(ConfigError, match="exists and is not empty"):
        export_run(run, tmp_path / "merged")
    # a full fine-tune exports its own weights (config, safetensors, tokenizer)
    full = starverse.build_model(folder)
    for p in full.parameters():
        p.data.add_(0.01)
    (tmp_path / "run_full").mkdir()
    record_model(tmp_path / "run_full", full, tokenizer=load_tokenizer(folder).tok)
    torch.save(full.state_dict(), tmp_path / "run_full" / "final_model.pt")
    assert export_run(tmp_path / "run_full", tmp_path / "full_out").merged
    with torch.no_grad():
        torch.testing.assert_close(AutoModelForCausalLM.from_pretrained(tmp_path / "full_out")(x).logits, full(x).logits)
    (run / "final_model.pt").unlink()
    with pytest.raises(ConfigError, match=r"final_model\.pt: missing; the run has not finished"):
        export_run(run, tmp_path / "again")


def _log(run: Path, rows: list[dict]) -> None:
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"type": "st')


def test_runs_are_read_from_their_logs_and_compared_in_a_png(tmp_path):
    start = {"type": "event", "event": "start", "step": 0, "time": 1.0, "max_steps": 3, "mode": "lora",
             "trainable_params": 10}
    steps = [{"type": "step", "step": s, "time": 1.0 + s, "loss": 4.0 - s, "tokens_per_s": 100.0 * s}
             for s in (1, 2, 3)]
    ev = {"type": "event", "event": "eval", "step": 3, "time": 5.0, "loss": 1.5, "perplexity": math.exp(1.5)}
    _log(tmp_path / "a", [start, *steps, ev, {"type": "event", "event": "end", "step": 3, "time": 6.0}])
    _log(tmp_path / "b", [start, *steps[:2]])
    a, b = read_run(tmp_path / "a"), read_run(tmp_path / "b")
    assert (a.status, a.steps, a.loss, a.eval_loss, a.tokens_per_s) == ("finished", 3, 1.0, 1.5, 250.0)
    assert (b.status, b.steps, b.eval_loss) == ("incomplete", 2, None)
    png = plot_loss_curves([a, b], tmp_path / "c.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    with pytest.raises(ConfigError, match=r"no metrics\.jsonl, so not a run directory"):
        read_run(tmp_path)


def _ctx(tmp_path: Path, step: int = 0):
    from starverse.runtime.callbacks import TrainContext

    model = TinyLM()
    plan = starverse.accelerate(num_cpu_ranks=1, seq_len=16, global_batch=2).plan
    opt = torch.optim.AdamW(model.parameters())
    ctx = TrainContext(rank=0, world_size=1, plan=plan, run_dir=tmp_path, step=step, model=model, optimizer=opt,
                       lr_scheduler=None, sampler=None, group=None, device_kind="cpu", max_steps=4)
    ctx.metrics.shares = [2]
    return ctx


def test_progress_is_a_bar_on_a_terminal_and_plain_lines_otherwise(tmp_path, capsys):
    from starverse.runtime.runlog import ProgressCallback, RunLogCallback

    ctx = _ctx(tmp_path)
    bar, plain, runlog = ProgressCallback(tty=True), ProgressCallback(every=2, tty=False), RunLogCallback()
    for cb in (bar, plain, runlog):
        cb.on_fit_start(ctx)
    for step in range(1, 5):
        ctx.step, ctx.metrics.loss, ctx.metrics.tokens_per_s = step, 5.0 - step, 1000.0 * step
        if step == 4:
            ctx.extra["eval"] = {"step": 4, "loss": 1.25, "perplexity": math.exp(1.25), "tokens": 9, "sequences": 1}
        for cb in (bar, plain, runlog):
            cb.on_step_end(ctx)
    task = bar._bar.tasks[0]
    assert task.completed == 4 and task.total == 4 and "loss 1.0000" in task.fields["info"]
    for cb in (bar, plain, runlog):
        cb.on_fit_end(ctx)
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("step ")]
    assert [ln.split()[1] for ln in lines] == ["1/4", "2/4", "4/4"]
    assert "loss 3.0000 tokens/s 2,000 shares [2]" in lines[1] and "eval 1.2500 (ppl 3.49 @4)" in lines[2]
    assert "eval at step 4: loss 1.2500, perplexity 3.49" in err
    rows = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("event", r["type"]) for r in rows] == ["start", "step", "step", "step", "step", "eval", "end"]
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_a_lora_state_saves_and_restores_the_adapters_only(tiny, tmp_path):
    from starverse.checkpoint.state import apply_train_state, train_state
    from starverse.errors import CheckpointError
    from starverse.runtime.steps import make_optimizer

    folder = tiny[0]
    model = starverse.build_model(folder)
    apply_lora(model, 4)
    opt = make_optimizer(model, 1e-2, 0.0)
    x = torch.randint(0, 200, (2, 12))
    for _ in range(2):
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    sd = train_state(model, opt)
    assert sd["model"] and all(".lora_" in k for k in sd["model"])
    fresh = starverse.build_model(folder)
    apply_lora(fresh, 4)
    fresh_opt = make_optimizer(fresh, 1e-2, 0.0)
    apply_train_state(fresh, fresh_opt, sd)
    assert _same(fresh, model)
    ctx = _ctx(tmp_path)
    ctx.model, ctx.optimizer = fresh, fresh_opt
    state = ctx.state_dict()
    assert all(".lora_" in k for k in state["model"])
    state["model"] = {k: v for k, v in state["model"].items() if "layers.0." not in k}
    with pytest.raises(CheckpointError, match=r"trainable tensor\(s\) missing"):
        ctx.load_state_dict(state)
