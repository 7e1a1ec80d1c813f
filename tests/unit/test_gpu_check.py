"""The prepared GPU check skips cleanly where there is no GPU: the whole script without CUDA, and its QLoRA part
where 4-bit weights cannot run (it says why). (What it measures needs a GPU: see benchmarks/gpu_check.py.)"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from helpers import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks/gpu_check.py"


def test_without_cuda_the_script_prints_skipped_and_exits_0():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"skipped": "no CUDA device"}


def test_the_qlora_part_reports_why_it_cannot_run_on_a_cpu():
    gpu_check = load_script(SCRIPT, "gpu_check")
    args = argparse.Namespace(batch=1, seq_len=8)
    out = gpu_check.qlora_check(gpu_check.LLAMA_1B, args, torch.device("cpu"))
    assert out.keys() == {"skipped"} and "not CUDA devices" in out["skipped"]
