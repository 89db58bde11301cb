"""bench/gpu_learner.py, the GPU check of the learner (issue 38), runs on the CPU at a tiny size:
the same code path a GPU run takes (the learner built as ``saoserve learn`` builds it, timed steps,
the FLOP count over the bf16 matmul rate), so the script is known to work before a GPU is lent."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from core.hardware import bf16_native
from testing import ROOT

pytestmark = pytest.mark.slow


def test_the_gpu_check_runs_on_the_cpu_at_a_tiny_size(tmp_path):
    args = ["--size", "tiny", "--batches", "2,4", "--seq", "32", "--prompt", "16", "--steps", "1"]
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_learner.py"), *args, "--out", str(tmp_path)],
        cwd=ROOT,
        env=os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads((tmp_path / "gpu_learner.json").read_text())
    assert doc["device"] == "CPU"
    # 2 policies × 2 batch sizes, one rank each (no GPU, so no 2-rank row).
    assert [(r["policy"], r["rows"], r["ranks"]) for r in doc["rows"]] == [
        ("full", 2, 1),
        ("full", 4, 1),
        ("lora", 2, 1),
        ("lora", 4, 1),
    ]
    for row in doc["rows"]:
        assert row["oom"] is False and row["tokens"] == row["rows"] * 32
        assert row["step_s"] > 0 and row["tokens_per_s"] == pytest.approx(row["tokens"] / row["step_s"])
        assert row["bf16_fraction"] > 0
        # The fraction of the bf16 matmul rate: below 1 where the step runs in bf16. On a CPU
        # without bf16 units the step runs in float32 (core.hardware) and bf16 matmuls are far
        # slower than it, so the ratio can pass 1 and bounds nothing.
        if bf16_native():
            assert row["bf16_fraction"] < 1
