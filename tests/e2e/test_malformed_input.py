"""Every malformed input is one clean error: exit 2, one line on stderr naming file, field and fix, no traceback,
no hang (issue 15). One row per case; keep the table growing.

Each row writes the files of a user's project (a planning job and pool, a plan, a training job) with one thing
wrong, runs the CLI in this process (``starverse.cli.main``: an exception other than a ``StarverseError``
escapes it, and fails the test with its traceback) and checks the one line it prints. pytest-timeout turns a
hang into a failure.
"""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from helpers import TINY
from starverse.cli import main

JOB = "model: llama-2-7b\ntrain: {seq_len: 4096, global_batch: 128, tokens: 2.0e9}\nconstraints: {max_budget_per_hour: 20}\n"
POOL = "currency: USD\noffers:\n  - {accelerator: rtx-4090, count: 16, price_per_hour: 0.69}\ncross_offer_gbps: 100\n"
PLAN = ("model: llama-2-7b\ntrain: {seq_len: 4096, global_batch: 128}\ngroups:\n  - replicas: 1\n    stages:\n"
        "      - {accelerator: a100-80gb-sxm, tp: 8, layers: 32}\n")
TRAIN = ("model: tiny.json\ndataset: docs\nrun_dir: run\ndevices: {cpu_ranks: 1}\n"
         "train: {steps: 3, seq_len: 16, global_batch: 4, micro_batch: 2}\ncheckpoint: {interval_steps: 2}\n")
CASE = ("model: llama-2-7b\ntrain: {seq_len: 4096, global_batch: 128}\ngroups:\n  - stages:\n"
        "      - {accelerator: a100-80gb-sxm, tp: 8, layers: 32}\nmeasured: {tokens_per_s: 1000}\nsource: test\n")


def _bomb(levels: int = 9) -> str:
    """A billion-laughs value: 9 aliases of 9 aliases ... (9**levels strings once expanded)."""
    anchors = ['&a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    anchors += [f"&a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, levels)]
    return "[" + ",\n  ".join(anchors) + "]"


@dataclass(frozen=True)
class Case:
    """One malformed input: files written over the defaults, the command line, the expected error line."""

    id: str
    argv: tuple[str, ...]
    expect: str
    """A part of the error line (after ``error: ``); ``{d}`` is the project folder."""
    files: dict[str, str | bytes] = field(default_factory=dict)


PLAN_ARGV = ("plan", "job.yaml", "--pool", "pool.yaml")
TRAIN_ARGV = ("train", "train.yaml")
LLAMA = JOB.splitlines()[0]

CASES = [
    # --- YAML itself: duplicate keys, alias bombs, recursive aliases, absurd numbers
    Case("duplicate-key-job", PLAN_ARGV, "job.yaml:2: model: duplicate key (first given at line 1)",
         {"job.yaml": LLAMA + "\n" + JOB}),
    Case("duplicate-key-flow-mapping", PLAN_ARGV, "job.yaml:2: train.seq_len: duplicate key",
         {"job.yaml": JOB.replace("seq_len: 4096,", "seq_len: 4096, seq_len: 2048,")}),
    Case("duplicate-key-pool", PLAN_ARGV, "pool.yaml:5: cross_offer_gbps: duplicate key (first given at line 4)",
         {"pool.yaml": POOL + "cross_offer_gbps: 10\n"}),
    Case("duplicate-key-plan", ("estimate", "plan.yaml"), "plan.yaml:7: model: duplicate key",
         {"plan.yaml": PLAN + "model: llama-2-13b\n"}),
    Case("duplicate-key-train", TRAIN_ARGV, "train.yaml:7: dataset: duplicate key (first given at line 2)",
         {"train.yaml": TRAIN + "dataset: other\n"}),
    Case("duplicate-key-catalog", ("catalog", "--catalog", "cat.yaml"), "cat.yaml:3: currencies: duplicate key",
         {"cat.yaml": "currencies: {}\noffers: []\ncurrencies: {}\n"}),
    Case("alias-bomb-in-a-field", PLAN_ARGV, "model[8][8][8][8]: expands to more than 200,000 values",
         {"job.yaml": JOB.replace("model: llama-2-7b", "model: " + _bomb())}),
    Case("alias-bomb-in-pool", PLAN_ARGV, "expands to more than 200,000 values",
         {"pool.yaml": POOL + "x: " + _bomb() + "\n"}),
    Case("recursive-alias", PLAN_ARGV, "job.yaml:1: model[1]: recursive alias",
         {"job.yaml": JOB.replace("model: llama-2-7b", "model: &m [1, *m]")}),
    Case("integer-of-5000-digits", PLAN_ARGV, "job.yaml: malformed YAML: Exceeds the limit (4300 digits)",
         {"job.yaml": JOB.replace("seq_len: 4096", "seq_len: " + "9" * 5000)}),
    Case("top-level-list", PLAN_ARGV, "job.yaml: expected a mapping at top level, got list",
         {"job.yaml": "- a\n- b\n"}),
    Case("two-documents", PLAN_ARGV, "job.yaml:4: malformed YAML: expected a single document in the stream but "
         "found another document", {"job.yaml": JOB + "---\n" + JOB}),
    Case("job-file-is-binary", PLAN_ARGV, "job.yaml: cannot read (UnicodeDecodeError: byte 0xff at offset 0 is not UTF-8",
         {"job.yaml": b"\xff\xfe\x00\x01" * 100}),
    # --- non-finite numbers where a finite one is meant
    Case("tokens-inf", PLAN_ARGV, "job.yaml:2: train.tokens: must be a finite number (got inf)",
         {"job.yaml": JOB.replace("2.0e9", ".inf")}),
    Case("tokens-1e400", PLAN_ARGV, "job.yaml:2: train.tokens: must be a finite number",
         {"job.yaml": JOB.replace("2.0e9", "1e400")}),
    Case("tokens-nan", PLAN_ARGV, "job.yaml:2: train.tokens: must be a finite number (got nan)",
         {"job.yaml": JOB.replace("2.0e9", ".nan")}),
    Case("max-budget-per-hour-inf", PLAN_ARGV,
         "job.yaml:3: constraints.max_budget_per_hour: must be a finite number (got inf)",
         {"job.yaml": JOB.replace("max_budget_per_hour: 20", "max_budget_per_hour: .inf")}),
    Case("cross-offer-gbps-inf", PLAN_ARGV, "pool.yaml:4: cross_offer_gbps: must be a finite number (got inf)",
         {"pool.yaml": POOL.replace("cross_offer_gbps: 100", "cross_offer_gbps: .inf")}),
    Case("price-nan", PLAN_ARGV, "pool.yaml:3: offers[0].price_per_hour: must be a finite number (got nan)",
         {"pool.yaml": POOL.replace("0.69", ".nan")}),
    Case("lr-inf", TRAIN_ARGV, "train.yaml:5: train.lr: must be a finite number (got inf)",
         {"train.yaml": TRAIN.replace("micro_batch: 2}", "micro_batch: 2, lr: .inf}")}),
    Case("linger-inf", TRAIN_ARGV, "train.yaml:7: metrics.linger_s: must be a finite number (got inf)",
         {"train.yaml": TRAIN + "metrics: {linger_s: .inf}\n"}),
    Case("grace-nan", TRAIN_ARGV, "train.yaml:6: checkpoint.grace_s: must be a finite number (got nan)",
         {"train.yaml": TRAIN.replace("interval_steps: 2}", "interval_steps: 2, grace_s: .nan}")}),
    Case("catalog-tflops-inf", ("catalog", "--catalog", "cat.yaml"),
         "cat.yaml:1: accelerators.rtx-4090.bf16_tflops: must be a finite number",
         {"cat.yaml": "accelerators: {rtx-4090: {bf16_tflops: .inf}}\n"}),
    # --- sizes bounded where arithmetic would overflow or allocate, the bound in the message
    Case("global-batch-1e18", PLAN_ARGV, "job.yaml:2: train.global_batch: must be less than or equal to 65536",
         {"job.yaml": JOB.replace("global_batch: 128", "global_batch: 1000000000000000000")}),
    Case("seq-len-1e12-train", TRAIN_ARGV, "train.yaml:5: train.seq_len: must be less than or equal to 16777216",
         {"train.yaml": TRAIN.replace("seq_len: 16", "seq_len: 1000000000000")}),
    Case("billing-granularity-1e20", PLAN_ARGV,
         "pool.yaml:3: offers[0].billing_granularity_s: must be less than or equal to 316224000",
         {"pool.yaml": POOL.replace("0.69}", "0.69, billing_granularity_s: 100000000000000000000}")}),
    Case("offer-count-1e9", PLAN_ARGV, "offers[0].count: must be less than or equal to 1048576",
         {"pool.yaml": POOL.replace("count: 16", "count: 1000000000")}),
    Case("num-hidden-layers-1e15", PLAN_ARGV, "layers.json: num_hidden_layers must be at most 16,384",
         {"job.yaml": JOB.replace("llama-2-7b", "layers.json"),
          "layers.json": json.dumps({**TINY, "num_hidden_layers": 10**15})}),
    Case("hidden-size-1e12-train", TRAIN_ARGV, "big.json: hidden_size must be at most 134,217,728",
         {"train.yaml": TRAIN.replace("tiny.json", "big.json"), "big.json": json.dumps({**TINY, "hidden_size": 10**12})}),
    Case("model-config-5000-digit-number", ("models", "huge.json"), "huge.json: malformed JSON",
         {"huge.json": '{"model_type": "llama", "hidden_size": ' + "9" * 5000 + "}"}),
    Case("budget-total-1e30", TRAIN_ARGV, "billing.budget_total: must be less than or equal to 1000000000000",
         {"train.yaml": TRAIN + "billing: {budget_total: 1.0e30}\n"}),
    Case("seed-negative", TRAIN_ARGV, "train.yaml:5: train.seed: must be greater than or equal to 0",
         {"train.yaml": TRAIN.replace("micro_batch: 2}", "micro_batch: 2, seed: -1}")}),
    Case("seed-beyond-64-bits", TRAIN_ARGV, "train.seed: must be less than or equal to 9223372036854775807",
         {"train.yaml": TRAIN.replace("micro_batch: 2}", "micro_batch: 2, seed: 100000000000000000000000}")}),
    # --- names and file arguments
    Case("model-name-300-chars", PLAN_ARGV, "job.yaml:1: model: a name or path has at most 255 bytes between "
         "slashes (got 300)", {"job.yaml": JOB.replace("llama-2-7b", "a" * 300)}),
    Case("model-name-nul-byte", PLAN_ARGV, "job.yaml:1: model: a name or path cannot contain a NUL byte",
         {"job.yaml": JOB.replace("llama-2-7b", '"llama\\0x"')}),
    Case("dataset-name-300-chars", TRAIN_ARGV, "train.yaml:2: dataset: a name or path has at most 255",
         {"train.yaml": TRAIN.replace("dataset: docs", "dataset: " + "d" * 300)}),
    Case("plan-out-missing-dir", (*PLAN_ARGV, "--out", "missing/plan.yaml"),
         "--out missing/plan.yaml: the folder missing does not exist"),
    Case("plan-out-dot", (*PLAN_ARGV, "--out", "."), "--out .: is a directory"),
    Case("plan-out-under-a-file", (*PLAN_ARGV, "--out", "pool.yaml/plan.yaml"),
         "the folder pool.yaml is a file, not a directory"),
    Case("plot-missing-dir", (*PLAN_ARGV, "--plot", "missing/frontier.png"),
         "--plot missing/frontier.png: the folder missing does not exist"),
    Case("run-dir-is-a-file", TRAIN_ARGV, "train.yaml:3: run_dir: {d}/afile is a file, not a directory",
         {"train.yaml": TRAIN.replace("run_dir: run", "run_dir: afile"), "afile": "x"}),
    Case("dataset-is-binary", TRAIN_ARGV, "train.yaml:2: dataset: {d}/data.bin is not a text file",
         {"train.yaml": TRAIN.replace("dataset: docs", "dataset: data.bin"), "data.bin": bytes(range(256)) * 64}),
    Case("job-file-is-a-directory", ("train", "docs"), "docs: cannot read (IsADirectoryError: a folder, not a file). To fix: give the path of a YAML file"),
    Case("option-nan", ("demo", "--corpus-mb", "nan", "--run-dir", "run"), "--corpus-mb: must be a finite number (got nan)"),
    Case("option-inf", ("simulate", "plan.yaml", "--trace", "t.csv", "--hours", "inf"),
         "--hours: must be a finite number (got inf)"),
    Case("demo-run-dir-is-a-file", ("demo", "--run-dir", "afile", "--steps", "1"),
         "--run-dir: {d}/afile is a file, not a directory", {"afile": "x"}),
    Case("profile-json-nested-too-deep", ("catalog", "--profile", "deep.json"),
         "deep.json: malformed probe profile JSON: maximum recursion depth exceeded", {"deep.json": "[" * 100_000}),
    Case("profile-figure-infinity", ("catalog", "--profile", "p.json"),
         "p.json: accelerators.cpu.bf16_tflops: must be a finite number (got inf)",
         {"p.json": '{"version": 1, "host": "h", "measured_at": "t", "accelerators": {"cpu": {"bf16_tflops": Infinity}}}'}),
    Case("model-config-nested-too-deep", ("models", "deep.json"), "deep.json: malformed JSON: maximum recursion",
         {"deep.json": "[" * 100_000 + "]" * 100_000}),
    Case("validate-empty-directory", ("validate", "empty"), "empty: no validation cases (*.yaml) here",
         {"empty/.keep": ""}),
    Case("validate-malformed-case", ("validate", "cases"),
         "cases/bad.yaml:3: groups: List should have at least 1 item", {"cases/bad.yaml": CASE.replace(
             "  - stages:\n      - {accelerator: a100-80gb-sxm, tp: 8, layers: 32}\n", "").replace(
             "groups:", "groups: []")}),
    # --- second-pass errors (the plan against its model and catalog; the job against its model) name the line
    Case("plan-tp-does-not-divide-heads", ("estimate", "plan.yaml"),
         "plan.yaml:6: groups[0].stages[0].tp: 3 does not divide the model's 32 attention heads",
         {"plan.yaml": PLAN.replace("tp: 8", "tp: 3")}),
    Case("plan-layers-do-not-sum", ("estimate", "plan.yaml"),
         "plan.yaml:6: groups[0].stages: layers sum to 30 but model 'llama-2-7b' has 32",
         {"plan.yaml": PLAN.replace("layers: 32", "layers: 30")}),
    Case("plan-unknown-accelerator", ("estimate", "plan.yaml"),
         "plan.yaml:6: groups[0].stages[0].accelerator: unknown accelerator",
         {"plan.yaml": PLAN.replace("a100-80gb-sxm", "a100-80gb-sxn")}),
    Case("plan-unknown-model", ("estimate", "plan.yaml"), "plan.yaml:1: model: unknown model 'llama-2-7c'",
         {"plan.yaml": PLAN.replace("llama-2-7b", "llama-2-7c")}),
    Case("train-seq-len-beyond-positions", TRAIN_ARGV,
         "train.yaml:5: train.seq_len: 300 exceeds the 256 positions of model",
         {"train.yaml": TRAIN.replace("seq_len: 16", "seq_len: 300")}),
]


def _write(root: Path, files: dict[str, str | bytes]) -> None:
    for name, content in files.items():
        p = root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            p.write_bytes(content)
        else:
            p.write_text(content)


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A user's folder with a valid job, pool, plan, training job, model config and corpus."""
    _write(tmp_path, {"job.yaml": JOB, "pool.yaml": POOL, "plan.yaml": PLAN, "train.yaml": TRAIN,
                      "tiny.json": json.dumps(TINY), "docs/a.txt": "the quick brown fox jumps over the lazy dog\n" * 50})
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("STARVERSE_PROFILE", "")  # plan on datasheet figures: never probe this machine
    monkeypatch.setenv("STARVERSE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("COLUMNS", "400")  # one line, however long
    return tmp_path


def run_cli(argv: tuple[str, ...] | list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """Run the CLI in this process; return its exit code and stderr."""
    code = main(list(argv))
    return code, capsys.readouterr().err


def assert_one_clean_error(code: int, err: str, expect: str) -> None:
    """Exit 2 and exactly one line ``error: ...`` containing ``expect``."""
    lines = err.strip().splitlines()
    assert code == 2, err
    assert "Traceback" not in err
    assert len(lines) == 1, err
    assert lines[0].startswith("error: "), err
    assert expect in lines[0], f"{expect!r} not in {lines[0]!r}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_malformed_input_is_one_clean_error(case: Case, project: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _write(project, case.files)
    code, err = run_cli(case.argv, capsys)
    assert_one_clean_error(code, err, case.expect.replace("{d}", str(project)))


@pytest.mark.timeout(120)
def test_metrics_port_in_use(project: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        _write(project, {"train.yaml": TRAIN + f"metrics: {{port: {port}}}\n"})
        code, err = run_cli(TRAIN_ARGV, capsys)
    assert_one_clean_error(code, err, f"train.yaml:7: metrics.port: port {port} on 127.0.0.1 is in use")


def test_bounded_repr_of_a_huge_value() -> None:
    """The message quoting a wrong value never builds the whole value (an alias bomb below the size limit)."""
    from pydantic import ValidationError

    from starverse.config import validation_message
    from starverse.plan import Plan

    big = [["x" * 1000] * 1000] * 100
    with pytest.raises(ValidationError) as e:
        Plan.model_validate({"model": big, "train": {"seq_len": 1, "global_batch": 1}, "groups": []})
    _, text = validation_message(Plan, e.value)
    assert len(text) < 200 and text.startswith("model: must be a valid string")



def test_validate_names_the_line_of_a_case_the_estimator_refuses(project: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """A well-formed case the model refuses is a failed case (exit 1), its reason naming file, line and field."""
    _write(project, {"cases/tp.yaml": CASE.replace("tp: 8", "tp: 3")})
    code, err = run_cli(("validate", "cases"), capsys)
    assert code == 1
    assert "case tp failed: cases/tp.yaml:5: groups[0].stages[0].tp: 3 does not divide" in err
