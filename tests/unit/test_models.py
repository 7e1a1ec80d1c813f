"""The model registry: parameter counts equal transformers' (meta device), lookups, every error message."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from starverse.errors import ConfigError, ModelError
from starverse.models import CONFIG_DIR, FAMILIES, ModelSpec, bundled_ids, list_models, load_model

REPO = Path(__file__).resolve().parents[2]
VALIDATION_MODELS = sorted((REPO / "data/validation/models").glob("*.json"))


def _transformers_count(spec: ModelSpec) -> int:
    """Parameters of the model transformers builds from the same config (meta device: nothing allocated)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    raw = dict(spec.hf_config)
    cfg = transformers.AutoConfig.for_model(raw.pop("model_type"), **raw)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("short", list(bundled_ids()))
def test_bundled_num_params_equal_transformers(short: str) -> None:
    spec = load_model(short)
    assert spec.num_params == _transformers_count(spec)


@pytest.mark.parametrize("path", VALIDATION_MODELS, ids=lambda p: p.stem)
def test_validation_num_params_equal_transformers(path: Path) -> None:
    spec = load_model(path)
    assert spec.num_params == _transformers_count(spec)


def test_published_sizes() -> None:
    """Counts that model cards state (exact where the card gives them)."""
    assert load_model("llama-2-7b").num_params == 6_738_415_616
    assert load_model("gpt2").num_params == 124_439_808
    assert load_model("llama-3.1-405b").num_params == pytest.approx(405.85e9, rel=1e-3)
    assert load_model("mixtral-8x7b").num_params == pytest.approx(46.7e9, rel=1e-3)
    assert load_model("bloom-176b").num_params == pytest.approx(176.25e9, rel=1e-3)
    assert 10e6 <= load_model("llama-tiny").num_params <= 20e6
    assert 0.9e9 <= load_model("llama-1b").num_params <= 1.3e9


def test_megatron_gpt_configs_follow_narayanan_eq2() -> None:
    """P = 12 l h^2 (1 + 13/(12h) + (V+s)/(12 l h)) (data/reference/formulas.csv) for the Megatron GPT configs."""
    for path in VALIDATION_MODELS:
        if not path.stem.startswith("gpt-"):
            continue
        s = load_model(path)
        nl, h, v, p = s.num_layers, s.hidden_size, s.vocab_size, s.max_seq_len
        eq2 = 12 * nl * h * h * (1 + 13 / (12 * h) + (v + p) / (12 * nl * h))
        lm_head = 0 if s.tie_embeddings else v * h
        # Eq. 2 counts a tied head and omits the final LayerNorm (2h)
        assert s.num_params == pytest.approx(eq2 + lm_head + 2 * h, rel=1e-9), path.stem


def test_architecture_facts() -> None:
    l70 = load_model("llama-2-70b")
    assert (l70.num_kv_heads, l70.head_dim, l70.gated_mlp, l70.norm, l70.position) == (8, 128, True, "rmsnorm", "rope")
    assert l70.lm_head_params == l70.vocab_size * l70.hidden_size and not l70.tie_embeddings
    assert l70.attn_params_per_layer == 8192 * 8192 * 2 + 2 * 8192 * 1024

    mix = load_model("mixtral-8x7b")
    assert (mix.num_experts, mix.experts_per_token) == (8, 2)
    assert mix.params_per_layer - mix.active_params_per_layer == 6 * mix.mlp_params_per_expert
    assert mix.router_params_per_layer == 4096 * 8

    g = load_model("gpt2")
    assert (g.gated_mlp, g.position, g.tie_embeddings, g.lm_head_params) == (False, "learned", True, 0)
    assert g.embedding_params == 50257 * 768 + 1024 * 768
    assert g.qkv_bias and g.attn_out_bias and g.mlp_bias

    assert load_model("qwen2.5-7b").qkv_bias and not load_model("qwen2.5-7b").attn_out_bias
    assert load_model("bloom-176b").position == "alibi"
    assert load_model("mpt-7b").position == "alibi" and not load_model("mpt-7b").mlp_bias
    assert load_model("falcon-7b").num_kv_heads == 1  # multi-query
    assert load_model("falcon-40b").num_kv_heads == 8  # grouped in the new architecture
    assert load_model("opt-175b").num_positions == 2048 + 2


def test_every_family_has_a_bundled_config() -> None:
    assert {m.family for m in list_models()} == set(FAMILIES)


def test_index_matches_configs() -> None:
    index = json.loads((CONFIG_DIR / "index.json").read_text())["models"]
    files = {p.name for p in CONFIG_DIR.glob("*.json")} - {"index.json"}
    assert {e["file"] for e in index.values()} == files
    for short, entry in index.items():
        raw = json.loads((CONFIG_DIR / entry["file"]).read_text())
        assert raw["_name_or_path"] == entry["hf_id"]
        assert load_model(entry["hf_id"]).name == short


def test_lookups(tmp_path: Path) -> None:
    by_short = load_model("llama-2-70b")
    assert load_model("meta-llama/Llama-2-70b-hf") is by_short
    assert load_model("META-LLAMA/llama-2-70b-HF") is by_short  # HF ids are case-insensitive
    assert load_model("llama-3.2-1b").name == "llama-1b"  # alias
    assert by_short.hf_id == "meta-llama/Llama-2-70b-hf"

    cfg = dict(by_short.hf_config)
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "mine.json").write_text(json.dumps(cfg))
    assert load_model(tmp_path / "mine.json").num_params == by_short.num_params
    assert load_model("mine.json", base_dir=tmp_path).name == "mine"
    assert load_model(tmp_path / "m").name == "m"  # a directory holding config.json
    assert load_model(cfg).num_params == by_short.num_params


def test_pretrained_config_is_read_without_building() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.MistralConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=3,
                                     num_attention_heads=8, num_key_value_heads=2, vocab_size=1000)
    spec = load_model(cfg)
    assert (spec.family, spec.num_layers, spec.num_kv_heads, spec.head_dim) == ("mistral", 3, 2, 64)
    assert spec.num_params == _transformers_count(spec)
    # a config of a bundled model keeps the registry's short id
    raw = dict(load_model("qwen2.5-7b").hf_config)
    qwen = transformers.AutoConfig.for_model(raw.pop("model_type"), **raw)
    assert load_model(qwen).name == "qwen2.5-7b"


def test_spec_is_frozen_and_hashable() -> None:
    spec = load_model("gpt2")
    with pytest.raises(AttributeError):
        spec.num_layers = 3  # type: ignore[misc]
    assert hash(spec) == hash(load_model("openai-community/gpt2"))


def test_no_torch_import() -> None:
    code = (
        "import sys, starverse.models as m, starverse.catalog as c;"
        "m.list_models(); c.load_catalog(profile='');"
        "sys.exit(1 if 'torch' in sys.modules or 'transformers' in sys.modules else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


# ---- errors ------------------------------------------------------------------------------------------
def test_unknown_model_id() -> None:
    with pytest.raises(ModelError) as e:
        load_model("llama-2-70")
    msg = str(e.value)
    assert msg.startswith("unknown model 'llama-2-70'; did you mean 'llama-2-70b'")
    assert "pass a path to a Hugging Face config.json" in msg
    with pytest.raises(ModelError, match=r"unknown model 'zzz'; `starverse models` lists"):
        load_model("zzz")
    # an HF-style id gets HF ids back, properly cased
    with pytest.raises(ModelError, match=r"unknown model 'meta-llama/Llama-2-7b'; did you mean "
                       r"'meta-llama/Llama-2-7b-hf'"):
        load_model("meta-llama/Llama-2-7b")


def _config(tmp_path: Path, raw: object, name: str = "c.json") -> Path:
    p = tmp_path / name
    p.write_text(raw if isinstance(raw, str) else json.dumps(raw, indent=1))
    return p


MAXTEXT_TINY = {"model_type": "maxtext", "decoder_block": "default", "emb_dim": 32, "num_query_heads": 4,
                "head_dim": 16, "mlp_dim": 96, "num_decoder_layers": 2, "vocab_size": 128, "mlp_activations": ["relu"],
                "logits_via_embedding": True, "dropout_rate": 0.0}
"""A MaxText config (``model_type: maxtext``, estimates only): its default parallel block, a ReLU MLP, tied logits."""


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ({"model_type": "t5", "d_model": 512}, r"c\.json: model_type 't5' is not a supported family; supported: llama, "
         r"mistral, mixtral, qwen2, gpt2, gpt_neox, opt, bloom, mpt, falcon"),
        ({"hidden_size": 8}, r"c\.json: no model_type is not a supported family"),
        ('{"model_type": "llama",\n "hidden_size": }', r"c\.json:2: malformed JSON: Expecting value"),
        ([1, 2], r"c\.json: expected a JSON object \(a Hugging Face config.json\), got list"),
        ({"model_type": "llama", "num_attention_heads": 32, "num_key_value_heads": 5},
         r"c\.json: num_key_value_heads \(5\) must divide the number of attention heads \(32\)"),
        ({"model_type": "gpt2", "n_embd": 100, "n_head": 12},
         r"c\.json: n_embd \(100\) is not divisible by the number of heads \(12\)"),
        ({"model_type": "llama", "hidden_size": -4}, r"c\.json: hidden_size must be > 0 \(got -4\)"),
        ({"model_type": "llama", "num_hidden_layers": "32"}, r"c\.json: num_hidden_layers must be an integer"),
        ({"model_type": "mpt", "attn_config": {"alibi": False}},
         r"c\.json: attn_config\.alibi: only ALiBi MPT models are supported"),
        ({"model_type": "mpt", "attn_config": {"attn_type": "grouped_query_attention", "kv_n_heads": 2}},
         r"c\.json: attn_config\.attn_type: only multihead_attention MPT models are supported"),
        ({"model_type": "mixtral", "num_local_experts": 2, "num_experts_per_tok": 4},
         r"c\.json: num_experts_per_tok \(4\) exceeds num_local_experts \(2\)"),
        ({"model_type": "gpt2", "add_cross_attention": True}, r"c\.json: add_cross_attention: encoder-decoder"),
        ({"model_type": "opt", "tie_word_embeddings": "yes"}, r"c\.json: tie_word_embeddings must be true or false"),
        ({**MAXTEXT_TINY, "head_dim": None}, r"c\.json: required key 'head_dim' is missing"),
        ({**MAXTEXT_TINY, "decoder_block": None}, r"c\.json: required key 'decoder_block' is missing"),
        ({**MAXTEXT_TINY, "decoder_block": "gemma"}, r"c\.json: decoder_block 'gemma' is not read; read: default, llama2"),
        ({**MAXTEXT_TINY, "mlp_activations": "relu"},
         r"c\.json: mlp_activations must be a list of one or two activation names \(got 'relu'\)"),
        ({**MAXTEXT_TINY, "num_kv_heads": 3}, r"c\.json: num_kv_heads \(3\) must divide the number of attention heads"),
    ],
)
def test_bad_configs(tmp_path: Path, raw: object, expected: str) -> None:
    with pytest.raises(ModelError, match=expected):
        load_model(_config(tmp_path, raw))


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match=r"nope\.json: file not found; pass an existing config.json"):
        load_model(tmp_path / "nope.json")
    with pytest.raises(ModelError, match=r"nope\.json: file not found"):
        load_model("nope.json", base_dir=tmp_path)


def test_architectures_key_when_model_type_missing(tmp_path: Path) -> None:
    raw = {"architectures": ["RWForCausalLM"], "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2}
    assert load_model(_config(tmp_path, raw)).family == "falcon"


def test_spec_pickles() -> None:
    import pickle

    spec = load_model("mixtral-8x7b")
    again = pickle.loads(pickle.dumps(spec))
    assert again == spec and dict(again.hf_config) == dict(spec.hf_config)
    with pytest.raises(TypeError, match="read-only"):
        spec.hf_config["hidden_size"] = 1  # type: ignore[index]



MAXTEXT = REPO / "data/validation/maxtext-tpu"


def _maxtext_make_cases() -> object:
    from helpers import load_script

    return load_script(MAXTEXT / "make_cases.py", "maxtext_make_cases")


@pytest.mark.parametrize("size", ["16b", "32b", "64b", "128b", "256b", "512b", "1024b"])
def test_maxtext_case_models_hold_maxtexts_parameters(size: str) -> None:
    """The MaxText TPU case models (MaxText configs, data/validation/maxtext-tpu/make_cases.py) count what MaxText's
    ``calculate_num_params_from_pytree`` counted (the FLOPs its TFLOP/s figures were computed with): exactly for
    its 2024 block, within 0.001 % where the 2023 one adds QK norms and relative position biases."""
    make_cases: Any = _maxtext_make_cases()
    table = next(t for t in make_cases.TABLES if size in t.sizes)
    d = make_cases.dims(table.sizes[size][0])
    spec = load_model(MAXTEXT / "models" / f"maxtext-{size}.json")
    assert (spec.family, spec.parallel_attn_mlp, spec.gated_mlp, spec.head_dim) == ("maxtext", True, False, 256)
    assert spec.num_params == make_cases.maxtext_params(d, qk_norm_relpos=False)
    assert spec.num_params == pytest.approx(make_cases.maxtext_params(d, table.qk_norm_relpos), rel=1e-5)
    assert json.loads((MAXTEXT / "models" / f"maxtext-{size}.json").read_text()) == make_cases.model_json(d)


def test_a_maxtext_config_is_read_for_estimates_and_refused_where_a_model_is_built() -> None:
    """MaxText's keys give its shapes (the parallel block's one norm, a ReLU MLP of two matrices; ``llama2``: two
    norms, gated); the runtime, which builds transformers models, refuses it in one line naming the fix."""
    from starverse.runtime.modeling import build_model

    spec = load_model(dict(MAXTEXT_TINY))
    h, q, f = 32, 4 * 16, 96
    assert spec.num_params == 128 * h + 2 * (4 * h * q + 2 * h * f + h) + h
    assert spec.parallel_attn_mlp and not spec.gated_mlp and spec.tie_embeddings
    seq = load_model({**MAXTEXT_TINY, "decoder_block": "llama2", "mlp_activations": ["silu", "linear"]})
    assert not seq.parallel_attn_mlp and seq.gated_mlp
    assert seq.num_params == 128 * h + 2 * (4 * h * q + 3 * h * f + 2 * h) + h
    with pytest.raises(ModelError, match=r"model_type 'maxtext' is read for estimates only .* To fix: train a "
                                         r"Hugging Face config"):
        build_model(dict(MAXTEXT_TINY))


def test_a_training_job_of_a_maxtext_model_is_refused_at_its_model_line(tmp_path: Path) -> None:
    """``starverse train`` (and the service at submit) checks a job's model before anything is written: an
    estimate-only family is one error at the job file's ``model:`` line."""
    from starverse.elastic.job import check_job_inputs, load_job

    (tmp_path / "m.json").write_text(json.dumps(MAXTEXT_TINY))
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.txt").write_text("some text to train on\n" * 50)
    (tmp_path / "job.yaml").write_text("model: m.json\ndataset: data\nrun_dir: run\n"
                                       "train: {steps: 2, seq_len: 32, global_batch: 4}\n")
    with pytest.raises(ConfigError, match=r"job\.yaml:1: model: .*m\.json: model_type 'maxtext' is read for "
                                         r"estimates only .* To fix: train a Hugging Face config"):
        check_job_inputs(load_job(tmp_path / "job.yaml"), str(tmp_path / "job.yaml"))
