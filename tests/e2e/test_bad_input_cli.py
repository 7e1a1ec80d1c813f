"""Bad command lines and files found by attacking the CLI as a new user would: each is one ``error:`` line
naming the file (or option), the field and the fix, exit code 2, no traceback, no hang.

The CLI runs in this process (``starverse.cli.main``): an exception other than a ``StarverseError`` escapes it
and fails the test with its traceback; pytest-timeout turns a hang into a failure.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from helpers import TINY
from starverse.cli import main

PLAN = ("model: llama-2-7b\ntrain: {seq_len: 4096, global_batch: 128}\ngroups:\n  - replicas: 1\n    stages:\n"
        "      - {accelerator: a100-80gb-sxm, tp: 8, layers: 32}\n")
JOB = "model: llama-2-7b\ntrain: {seq_len: 4096, global_batch: 128, tokens: 2.0e9}\n"
POOL = "currency: USD\noffers:\n  - {accelerator: rtx-4090, count: 16, price_per_hour: 0.69}\n"
POOL2 = ("currency: USD\noffers:\n  - {accelerator: rtx-4090, count: 8, price_per_hour: 0.69, name: a}\n"
         "  - {accelerator: rtx-4090, count: 8, price_per_hour: 0.69, name: b}\n")
PLAN_ARGV = ("plan", "job.yaml", "--pool", "pool.yaml")
TRACE = str(Path(__file__).resolve().parents[2] / "data" / "traces" / "bamboo" / "g4dn-trace.csv")
SIM_ARGV = ("simulate", "plan.yaml", "--trace", TRACE)

CASES: list[tuple[str, tuple[str, ...], dict[str, str], str]] = [
    # (id, argv, files over the defaults, a part of the one error line)
    # --- usage errors are one line naming the command and its --help, not click's multi-line panel
    ("option-below-its-minimum", (*PLAN_ARGV, "--top", "0"), {},
     "starverse plan: Invalid value for '--top': Input should be greater than or equal to 1. To fix: see "
     "`starverse plan --help`"),
    ("option-not-an-integer", (*PLAN_ARGV, "--top", "x"), {}, "Invalid value for '--top'"),
    ("missing-option", ("plan", "job.yaml"), {}, "starverse plan: Missing option '--pool'. To fix: see"),
    ("unknown-option", (*PLAN_ARGV, "--bogus"), {}, "starverse plan: No such option: --bogus"),
    ("unknown-command", ("bogus",), {}, "starverse: No such command 'bogus'. To fix: see `starverse --help`"),
    ("port-beyond-65535", ("train", "job.yaml", "--metrics-port", "70000"), {},
     "Invalid value for '--metrics-port': Input should be less than or equal to 65535"),
    # --- a boolean where a number is meant (pydantic alone reads `true` as 1)
    ("plan-tp-true", ("estimate", "plan.yaml"), {"plan.yaml": PLAN.replace("tp: 8", "tp: true")},
     "plan.yaml:6: groups[0].stages[0].tp: must be a number, not a boolean (got true)"),
    ("pool-count-true", PLAN_ARGV, {"pool.yaml": POOL.replace("count: 16", "count: true")},
     "pool.yaml:3: offers[0].count: must be a number, not a boolean (got true)"),
    ("pool-price-false", PLAN_ARGV, {"pool.yaml": POOL.replace("0.69", "false")},
     "pool.yaml:3: offers[0].price_per_hour: must be a number, not a boolean (got false)"),
    ("pool-links-true", PLAN_ARGV, {"pool.yaml": POOL2 + "network:\n  links:\n    a/b: true\n"},
     "pool.yaml:7: network.links.a/b: must be a number, not a boolean (got true)"),
    ("pool-collective-value-true", PLAN_ARGV, {"pool.yaml": POOL.replace("0.69}", "0.69,\n     collective_gb_per_s: {2: true}}")},
     "pool.yaml:4: offers[0].collective_gb_per_s[2]: must be a number, not a boolean (got true)"),
    ("pool-collective-key-true", PLAN_ARGV, {"pool.yaml": POOL.replace("0.69}", "0.69, collective_gb_per_s: {true: 3}}")},
     "pool.yaml:3: offers[0].collective_gb_per_s.true: must be a number, not a boolean (got true)"),
    ("plan-network-gbps-false", ("estimate", "plan.yaml"),
     {"plan.yaml": PLAN + "network:\n  inter_node_gbps:\n    a100-80gb-sxm: false\n"},
     "plan.yaml:9: network.inter_node_gbps.a100-80gb-sxm: must be a number, not a boolean (got false)"),
    ("job-seq-len-true", PLAN_ARGV, {"job.yaml": JOB.replace("seq_len: 4096", "seq_len: true")},
     "job.yaml:2: train.seq_len: must be a number, not a boolean (got true)"),
    # --- what is wrong with a model or a plan found after loading still names the file and the line
    ("plan-job-unknown-model", PLAN_ARGV, {"job.yaml": JOB.replace("llama-2-7b", "llama-9")},
     "job.yaml:1: model: unknown model 'llama-9'"),
    ("train-unknown-model", ("train", "train.yaml"), {"train.yaml": "dataset: job.yaml\nmodel: llama-9\n"},
     "train.yaml:2: model: unknown model 'llama-9'"),
    ("simulate-unknown-model", SIM_ARGV, {"plan.yaml": PLAN.replace("llama-2-7b", "llama-9")},
     "plan.yaml:1: model: unknown model 'llama-9'"),
    ("simulate-tp-does-not-divide-heads", SIM_ARGV, {"plan.yaml": PLAN.replace("tp: 8", "tp: 3")},
     "plan.yaml:6: groups[0].stages[0].tp: 3 does not divide"),
    ("simulate-unknown-accelerator", SIM_ARGV, {"plan.yaml": PLAN.replace("a100-80gb-sxm", "a100-80gb-sxn")},
     "plan.yaml:6: groups[0].stages[0].accelerator: unknown accelerator"),
    # --- link figures beyond any physical link (config.MAX_GBPS, 100 Tbit/s) made every transfer free
    ("pool-cross-offer-1e300", PLAN_ARGV, {"pool.yaml": POOL + "cross_offer_gbps: 1.0e300\n"},
     "pool.yaml:4: cross_offer_gbps: must be less than or equal to 100000"),
    ("pool-link-1e300", PLAN_ARGV, {"pool.yaml": POOL2 + "network:\n  links: {a/b: 1.0e300}\n"},
     "pool.yaml:6: network.links.a/b: must be less than or equal to 100000"),
    ("pool-nic-1e300", PLAN_ARGV, {"pool.yaml": POOL.replace("0.69}", "0.69, inter_node_gbps: 1.0e300}")},
     "pool.yaml:3: offers[0].inter_node_gbps: must be less than or equal to 100000"),
    ("pool-collective-1e300", PLAN_ARGV, {"pool.yaml": POOL.replace("0.69}", "0.69, collective_gb_per_s: {2: 1.0e300}}")},
     "pool.yaml:3: offers[0].collective_gb_per_s[2]: must be less than or equal to 12500"),
    # --- the plan's network figures are bounded as the pool's are (they made every transfer free, every plan fit)
    ("plan-link-1e300", ("estimate", "plan.yaml"), {"plan.yaml": PLAN + "network:\n  links: {a100-80gb-sxm/a100-80gb-sxm: 1.0e+300}\n"},
     "plan.yaml:8: network.links.a100-80gb-sxm/a100-80gb-sxm: must be less than or equal to 100000 (got 1e+300). To "
     "fix: give a number at most 100000"),
    ("plan-nic-1e300", ("estimate", "plan.yaml"), {"plan.yaml": PLAN + "network:\n  inter_node_gbps: {a100-80gb-sxm: 1.0e+300}\n"},
     "plan.yaml:8: network.inter_node_gbps.a100-80gb-sxm: must be less than or equal to 100000"),
    ("plan-cross-group-1e300", ("estimate", "plan.yaml"), {"plan.yaml": PLAN + "network:\n  cross_group_gbps: 1.0e+300\n"},
     "plan.yaml:8: network.cross_group_gbps: must be less than or equal to 100000"),
    ("plan-collective-1e300", ("estimate", "plan.yaml"),
     {"plan.yaml": PLAN + "network:\n  collective_gb_per_s: {a100-80gb-sxm: {8: 1.0e+300}}\n"},
     "plan.yaml:8: network.collective_gb_per_s.a100-80gb-sxm[8]: must be less than or equal to 12500"),
    ("plan-usable-memory-1e300", ("estimate", "plan.yaml"),
     {"plan.yaml": PLAN + "network:\n  usable_memory_gb: {a100-80gb-sxm: 1.0e+300}\n"},
     "plan.yaml:8: network.usable_memory_gb.a100-80gb-sxm: must be less than or equal to 100000"),
    ("plan-link-0", ("estimate", "plan.yaml"), {"plan.yaml": PLAN + "network:\n  links: {a100-80gb-sxm/a100-80gb-sxm: 0}\n"},
     "network.links.a100-80gb-sxm/a100-80gb-sxm: must be greater than 0 (got 0). To fix: give a number more than 0"),
    ("pool-link-0", PLAN_ARGV, {"pool.yaml": POOL2 + "network:\n  links: {a/b: 0}\n"},
     "pool.yaml:6: network.links.a/b: must be greater than 0 (got 0). To fix: give a number more than 0"),
    ("pool-link-unknown-offer", PLAN_ARGV, {"pool.yaml": POOL2 + "network:\n  links:\n    a/c: 10\n"},
     "pool.yaml:7: network.links.a/c: 'a/c' must name two offers as 'a/b'. To fix: use offer names (offers: a, b)"),
    ("pool-offer-named-twice", PLAN_ARGV, {"pool.yaml": POOL2.replace("name: b", "name: a")},
     "pool.yaml:4: offers[1].name: two offers are called 'a'. To fix: give each a distinct `name:`"),
    ("pool-host-memory-1e300", PLAN_ARGV, {"pool.yaml": POOL.replace("0.69}", "0.69, host_memory_gb: 1.0e+300}")},
     "pool.yaml:3: offers[0].host_memory_gb: must be less than or equal to 100000"),
    ("pool-interruptions-1e300", PLAN_ARGV, {"pool.yaml": POOL.replace(
        "0.69}", "0.69, spot_price_per_hour: 0.3, pricing: spot, interruptions_per_hour: 1.0e+300}")},
     "pool.yaml:3: offers[0].interruptions_per_hour: must be less than or equal to 3600"),
    # --- simulate: sizes that would allocate terabytes or never end are refused with the bound
    ("simulate-runs-1e12", (*SIM_ARGV, "--runs", "1000000000000"), {}, "'--runs': Input should be less than or equal to 100000"),
    ("simulate-hours-1e308", (*SIM_ARGV, "--hours", "1e308"), {}, "--hours: must be at most 87,840 (got 1e+308)"),
    ("simulate-restart-1e308", (*SIM_ARGV, "--restart-s", "1e308"), {}, "--restart-s: must be at most 3.16224e+08"),
    ("simulate-trace-nested-too-deep", ("simulate", "plan.yaml", "--trace", "t.json"), {"t.json": "[" * 100_000},
     "t.json: malformed trace (maximum recursion depth exceeded"),
    ("simulate-restart-longer-than-the-job-can-wait", (*SIM_ARGV, "--restart-s", "316224000"), {},
     "the simulated jobs do not finish within"),
    ("simulate-interval-that-draws-billions-of-losses", (*SIM_ARGV, "--interval-s", "0.001"), {},
     "loss events at once"),
    ("simulate-checkpoint-speed-1e308", (*SIM_ARGV, "--checkpoint-gb-per-s", "1e308"), {},
     "--checkpoint-gb-per-s: must be at most 12,500 (got 1e+308)"),
    # --- CPU ranks are processes: a million would fork the machine to a halt (probe hung building 1e20 of them)
    ("probe-ranks-1e20", ("probe", "--ranks", "99999999999999999999", "--quick", "--out", "p.json"), {},
     "--ranks: must be at most"),
    ("probe-ranks-0", ("probe", "--ranks", "0", "--quick", "--out", "p.json"), {}, "--ranks: must be at least 1"),
    ("demo-ranks-a-million", ("demo", "--ranks", "1000000", "--run-dir", "run"), {}, "--ranks: must be at most"),
    ("train-cpu-ranks-100000", ("train", "train.yaml"), {"train.yaml": "dataset: job.yaml\nmodel: tiny.json\n"
                                                                       "devices: {cpu_ranks: 100000}\n",
                                                         "tiny.json": json.dumps(TINY)},
     "train.yaml:3: devices.cpu_ranks: 100,000 is more than the"),
    ("train-seq-len-past-the-models-positions", ("train", "train.yaml"),
     {"train.yaml": "dataset: job.yaml\nmodel: tiny.json\ntrain: {seq_len: 100000}\n", "tiny.json": json.dumps(TINY)},
     "train.yaml:3: train.seq_len: 100000 exceeds the 256 positions of model"),
    # --- ledgers that are no file: SQLite blocked on a FIFO
    ("bill-a-fifo", ("bill", "--db", "fifo"), {}, "fifo: not a ledger file (a folder, device, FIFO or socket)"),
    ("bill-a-folder", ("bill", "--db", "."), {}, ".: not a ledger file"),
    # --- option values that overflowed or reached the OS before any check
    ("demo-corpus-mb-1e308", ("demo", "--corpus-mb", "1e308", "--run-dir", "run"), {},
     "--corpus-mb: must be > 0 and at most 100,000 (got 1e+308)"),
    ("demo-seq-len-1e11", ("demo", "--seq-len", "100000000000", "--run-dir", "run"), {},
     "--seq-len: must be at most 16,777,216"),
    ("models-name-5000-chars", ("models", "x" * 5000), {}, "a model id or path has at most 4096 characters"),
    ("estimate-name-5000-chars", ("estimate", "x" * 5000), {}, "file name too long (at most 255 bytes between slashes"),
    ("bill-name-5000-chars", ("bill", "x" * 5000), {}, "file name too long"),
    ("runs-name-5000-chars", ("runs", "x" * 5000), {}, "file name too long"),
    ("checkpoints-name-5000-chars", ("checkpoints", "list", "x" * 5000), {}, "file name too long"),
    # --- serve's admin commands: amounts past the ledger, a token that never expires, a root or
    # database that cannot be opened
    ("serve-credit-1e400", ("serve", "tenant", "create", "t", "--credit", "1e400", "--root", "svc"), {},
     "--credit: '1e400' is above 1,000,000,000,000, the largest amount the ledger holds"),
    ("serve-topup-1e30", ("serve", "tenant", "topup", "t", "1e30", "--root", "svc"), {}, "AMOUNT: '1e30' is above"),
    ("serve-token-ttl-1e308", ("serve", "token", "create", "t", "--ttl-hours", "1e308", "--root", "svc"), {},
     "--ttl-hours: must be at most 87,840"),
    ("serve-token-ttl-negative", ("serve", "token", "create", "t", "--ttl-hours", "-1", "--root", "svc"), {},
     "--ttl-hours: -1 gives a token that has expired when it is printed. To fix: pass at least"),
    ("serve-token-ttl-0", ("serve", "token", "create", "t", "--ttl-hours", "0", "--root", "svc"), {},
     "--ttl-hours: 0 gives a token that has expired"),
    ("serve-root-is-a-file", ("serve", "tenant", "create", "t", "--root", "job.yaml"), {},
     "--root job.yaml: cannot be the state directory"),
    ("serve-database-unreachable", ("serve", "tenant", "create", "t", "--root", "svc", "--database",
                                    "postgresql://postgres@127.0.0.1:1/x"), {}, "--database: cannot open the database"),
    ("probe-out-is-a-directory", ("probe", "--out", ".", "--quick"), {}, "--out .: is a directory"),
    ("plot-not-png", (*PLAN_ARGV, "--plot", "frontier.txt"), {},
     "--plot frontier.txt: the frontier is drawn as a PNG. To fix: give a file name ending in .png"),
]


@pytest.fixture
def folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A user's folder with a valid plan, job and pool."""
    for name, text in (("plan.yaml", PLAN), ("job.yaml", JOB), ("pool.yaml", POOL)):
        (tmp_path / name).write_text(text)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("STARVERSE_PROFILE", "")
    monkeypatch.setenv("STARVERSE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("COLUMNS", "400")
    os.mkfifo(tmp_path / "fifo")
    return tmp_path


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("argv", "files", "expect"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_clean_line(argv: tuple[str, ...], files: dict[str, str], expect: str, folder: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    for name, text in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    code = main(list(argv))
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert "Traceback" not in err and "\n" not in err, err
    assert err.startswith("error: ") and expect in err, f"{expect!r} not in {err!r}"


LOOP = "loop-a"
"""A symlink loop the folder holds (loop-a -> loop-b -> loop-a)."""
ODD_PATHS: list[tuple[str, tuple[str, ...], str]] = [
    # (id, argv, a part of the one error line): paths that are no file a command can read
    ("estimate-a-symlink-loop", ("estimate", LOOP), "loop-a: cannot read (OSError: Too many levels of symbolic links)"),
    ("estimate-dev-zero", ("estimate", "/dev/zero"), "/dev/zero: cannot read (not a regular file: a device, FIFO or"),
    ("plan-pool-a-fifo", (*PLAN_ARGV[:3], "fifo"), "fifo: cannot read (not a regular file"),
    ("estimate-a-folder", ("estimate", "."), ".: cannot read (IsADirectoryError: a folder, not a file). To fix: give"),
    ("estimate-a-binary-file", ("estimate", "bin.yaml"), "bin.yaml: cannot read (UnicodeDecodeError: byte 0xff at "
                                                         "offset 2 is not UTF-8"),
    ("models-dev-zero", ("models", "/dev/zero"), "To fix: give the path of a model's config.json"),
    ("runs-a-symlink-loop", ("runs", LOOP), "loop-a: a symlink loop (links that point at each other, or at "
                                            "themselves). To fix:"),
    ("runs-compare-a-symlink-loop", ("runs", "compare", LOOP, LOOP), "a symlink loop"),
    ("export-a-symlink-loop", ("export", LOOP, "--out", "x"), "a symlink loop"),
    ("demo-run-dir-a-symlink-loop", ("demo", "--run-dir", LOOP), "a symlink loop"),
    ("plan-profile-dev-zero", ("estimate", "profiled.yaml"), "network.profiles.a100-80gb-sxm: /dev/zero: cannot read "
                                                            "(not a regular file"),
    ("pool-profile-a-folder", (*PLAN_ARGV[:3], "profiled-pool.yaml"),
     "profiled-pool.yaml:3: offers[0].profile: empty: cannot read (IsADirectoryError: a folder, not a file)"),
    ("checkpoints-list-an-empty-folder", ("checkpoints", "list", "empty"),
     "empty: no complete checkpoint to resume from: it is empty. To fix: point at a run directory written by "
     "`starverse train` (it holds checkpoints/)"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("argv", "expect"), [c[1:] for c in ODD_PATHS], ids=[c[0] for c in ODD_PATHS])
def test_paths_that_are_no_readable_file_are_one_clean_line(argv: tuple[str, ...], expect: str, folder: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """A symlink loop (a traceback: pathlib raised RuntimeError), a device or FIFO (read forever, or blocked), a
    folder or a binary file where a file is meant: one line, exit 2, no hang."""
    (folder / LOOP).symlink_to("loop-b")
    (folder / "loop-b").symlink_to(LOOP)
    (folder / "bin.yaml").write_bytes(b"\x00\x01\xff\xfe")
    (folder / "empty").mkdir()
    (folder / "profiled.yaml").write_text(PLAN + "network: {profiles: {a100-80gb-sxm: /dev/zero}}\n")
    (folder / "profiled-pool.yaml").write_text(POOL.replace("0.69}", "0.69, profile: empty}"))
    code = main(list(argv))
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert "Traceback" not in err and "\n" not in err, err
    assert err.startswith("error: ") and expect in err, f"{expect!r} not in {err!r}"


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a file of mode 000")
def test_an_unreadable_file_is_one_clean_line(folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (folder / "plan.yaml").chmod(0)
    assert main(["estimate", "plan.yaml"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: plan.yaml: cannot read (PermissionError: Permission denied). To fix: give the path of a " \
                  "YAML file", err


def test_help_and_version_still_exit_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--help"]) == 0
    assert "Usage" in capsys.readouterr().out
    assert main(["version"]) == 0


def test_runs_lists_a_run_whose_log_has_binary_lines(folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Bytes that are not UTF-8 in metrics.jsonl (a torn write) spoil their line only: the run is still listed."""
    run = folder / "runs" / "r1"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_bytes(b'{"type": "step", "step": 1, "loss": 2.5}\n\xff\xfe\x00garbage\n' +
                                        b"[" * 100_000 + b"\n")
    assert main(["runs", "runs", "--json"]) == 0, capsys.readouterr().err
    assert "r1" in capsys.readouterr().out


def test_train_with_a_missing_dataset_names_the_field_and_writes_nothing(folder: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """A job file's missing dataset is refused with its file, line and field before the run folder exists."""
    examples = Path(__file__).resolve().parents[2] / "examples" / "train"
    (folder / "tiny-llama.json").write_text((examples / "tiny-llama.json").read_text())
    (folder / "train.yaml").write_text("model: tiny-llama.json\ndataset: no-such-corpus\nrun_dir: run\n"
                                       "train: {steps: 2, seq_len: 32, global_batch: 4, micro_batch: 2}\n"
                                       "devices: {cpu_ranks: 1}\n")
    assert main(["train", "train.yaml"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    assert "train.yaml:2: dataset:" in err and "does not exist" in err, err
    assert not (folder / "run").exists()


def test_a_bad_job_file_is_refused_before_the_runtime_is_imported(tmp_path: Path) -> None:
    """`starverse train` validates the job file before it imports the runtime (torch: seconds of start-up), so a
    bad file is one line at once; the refusal is the same one prepare_job would give."""
    import subprocess
    import sys

    job = tmp_path / "job.yaml"
    job.write_text("model: x\nbogus: 1\n")
    code = ("import sys; from starverse.cli import main; rc = main(['train', sys.argv[1]]); "
            "print('torch' in sys.modules, rc)")
    res = subprocess.run([sys.executable, "-c", code, str(job)], capture_output=True, text=True, timeout=60)
    assert res.stdout.split() == ["False", "2"], (res.stdout, res.stderr)
    assert f"{job}:2: bogus: unknown field" in res.stderr and len(res.stderr.strip().splitlines()) == 1
