"""GPU check of the learner: the SAO step (and its LoRA step) on a CUDA GPU, against its matmul rate.

Issue 38. Made for a GPU machine lent for a few minutes with no network and only Python 3.12,
torch (CUDA), transformers, peft and safetensors: no vLLM, no model download. The models are
built from configs with random weights (the step's cost does not depend on the weights):

- ``135m``: SmolLM2-135M's config (hidden 576, 30 layers, 9 heads / 3 KV heads, vocabulary 49152);
- ``1b``: the SmolLM2-1.7B shape (hidden 2048, 32 heads, intermediate 8192) with 16 of its 24
  layers, 1.2B parameters;
- ``tiny``: a 2-layer model, for the CPU run CI makes (tests/integration/test_gpu_learner_script.py).

For each size, policy (``full``, ``lora``: rank 8 on all projections) and batch (16 and 64 rows of
``--seq`` tokens, the last ``--seq − --prompt`` of them actions): ``SAOLearner.step`` as ``saoserve
learn`` builds it (critic K = 2, the KL anchor, the device's precision: bf16 where it is fast,
``learner.config.build_config``), one warm-up step, then ``--steps`` timed ones. Printed per row:
step time (median), tokens/s, peak GPU memory, and the achieved rate (``learner.models.flops``'s count of
the step's matmul FLOPs over its time) as a fraction of the bf16 matmul rate measured in the
same run (an 8192² × 8192 bf16 matmul on the same device). A step that runs out of memory is
reported as such. With 2 GPUs it also runs the full-policy step on 2 ranks (FSDP2 under torchrun,
``learner.models.placement``) at batch 64.

Run on a GPU (about 2-4 minutes; ``--out`` is the folder whose ``gpu_learner.json`` comes back):

    python bench/gpu_learner.py --out "$OUT"

then here: ``python bench/gpu_learner.py --ingest <path>/gpu_learner.json`` records the table
(``bench/results.py``: docs/results.md, ``gpu_learner``). The learner's config needs pydantic: where
it is not installed the script takes it from ``bench/gpu_vendor`` (``python bench/gpu_learner.py
--vendor`` fills that folder here with pydantic's cp312 manylinux wheels, unpacked, about 8 MB, to carry with
the check). On the CPU (CI): ``python bench/gpu_learner.py --size tiny --batches 2,4 --seq 32
--prompt 16 --steps 1``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENDOR = Path(__file__).resolve().parent / "gpu_vendor"
sys.path.insert(0, str(ROOT))

SHAPES = {
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
    "135m": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
    ),
    "1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=32,
    ),
}
VOCAB = {"tiny": 512, "135m": 49152, "1b": 49152}
VENDORED = (
    "pydantic==2.14.4",
    "pydantic-core==2.50.5",
    "annotated-types==0.8.0",
    "typing-inspection==0.4.5",
    "typing-extensions==4.16.0",
)
"""The venv's versions, for ``--vendor`` (the learner's config is checked with these)."""


def import_learner() -> None:
    """Make ``learner`` importable: its config needs pydantic, taken from ``bench/gpu_vendor``
    where the machine lacks it. Raises ImportError naming the fix when neither has it."""
    try:
        import pydantic  # noqa: F401
    except ImportError:
        if not VENDOR.is_dir():
            raise ImportError(
                "pydantic is not installed and bench/gpu_vendor is missing: run "
                "`python bench/gpu_learner.py --vendor` where pip reaches PyPI and carry bench/gpu_vendor"
            ) from None
        sys.path.insert(0, str(VENDOR))


def model_config(size: str):
    """The transformers config of ``size`` (SmolLM2 family: Llama, tied embeddings, RoPE 1e5)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB[size],
        max_position_embeddings=8192,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
        **SHAPES[size],
    )


def bf16_matmul_rate(device, n: int = 8192, reps: int = 20) -> float:
    """FLOP/s of an n×n by n×n bf16 matmul on ``device`` (the best of ``reps``)."""
    import torch

    n = n if device.type == "cuda" else 512
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    best = float("inf")
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        a @ b
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_batch(vocab: int, rows: int, seq: int, prompt: int, seed: int):
    """``rows`` rows of ``seq`` random tokens sharing the first ``prompt // 2`` (a system prompt),
    actions after ``prompt``; behaviour logprobs near a random model's (−log V)."""
    import math

    import torch

    from learner.data.batch import Batch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, seq), generator=g)
    ids[:, : prompt // 2] = ids[0, : prompt // 2]
    attn = torch.ones(rows, seq, dtype=torch.long)
    act = torch.zeros(rows, seq, dtype=torch.long)
    act[:, prompt:] = 1
    rollout = torch.where(act.bool(), -math.log(vocab), 0.0)
    rewards = torch.randint(0, 2, (rows,), generator=g).float()
    return Batch(ids, attn, act, rollout, rewards, torch.ones(rows))


def build(size: str, policy: str, rows: int, placement=None):
    """``SAOLearner`` of ``size`` as ``saoserve learn`` builds it, with a ``policy`` (full, lora)."""
    import torch
    from transformers import LlamaForCausalLM

    from learner.algo.registry import build_algorithm
    from learner.config import build_config

    overrides = {"batch_size": rows, "algorithm": {"kl_coef": 0.04}}
    if policy == "lora":
        overrides["policy"] = {"kind": "lora", "rank": 8}
    config = build_config("cpu", overrides=overrides)

    def load_policy():
        torch.manual_seed(0)
        return LlamaForCausalLM(model_config(size)).float()

    return build_algorithm(config, load_policy, placement), config


def measure(size: str, policy: str, rows: int, args, device, rate: float, placement=None) -> dict:
    """One row of the table (module docstring); ``oom`` set when the step ran out of memory."""
    import torch

    from learner.models.flops import Shape, Tokens, sao_step_flops

    row = {"size": size, "policy": policy, "rows": rows, "tokens": rows * args.seq}
    try:
        algorithm, config = build(size, policy, rows, placement)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        batches = [make_batch(VOCAB[size], rows, args.seq, args.prompt, s) for s in range(args.steps + 1)]
        times = []
        for i, batch in enumerate(batches):
            sync(device)
            t0 = time.perf_counter()
            algorithm.step(batch)
            sync(device)
            if i:
                times.append(time.perf_counter() - t0)
    except torch.OutOfMemoryError:
        return row | {
            "step_s": None,
            "tokens_per_s": None,
            "peak_gib": None,
            "bf16_fraction": None,
            "oom": True,
        }
    step = statistics.median(times)
    tokens = Tokens.rows(rows, args.seq, args.seq - args.prompt, shared_prefix=args.prompt // 2)
    flops = sao_step_flops(Shape.of(model_config(size)), tokens)["total"]
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return row | {
        "step_s": step,
        "tokens_per_s": rows * args.seq / step,
        "peak_gib": peak,
        "bf16_fraction": flops / step / rate,
        "oom": False,
        "bf16": config.bf16,
    }


def ranked(args) -> None:
    """Under torchrun: the full-policy step of ``args.size`` sharded over the ranks; rank 0 writes
    its row to ``args.rank_out``."""
    import torch.distributed as dist

    import_learner()
    from learner.config import Device
    from learner.models.device import resolve
    from learner.models.placement import Placement

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = resolve(Device.AUTO, int(os.environ.get("LOCAL_RANK", "0")))
    if device.type == "cuda":
        import torch

        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rate = bf16_matmul_rate(device)
    rows = args.batches[-1]
    placement = Placement(device, rank, world, bf16=device.type == "cuda")
    row = measure(args.sizes[-1], "full", rows, args, device, rate, placement)
    if rank == 0:
        Path(args.rank_out).write_text(json.dumps(row | {"ranks": world}))
    dist.destroy_process_group()


def vendor() -> None:
    """Download pydantic's wheels for CPython 3.12 on x86-64 Linux into ``bench/gpu_vendor`` and
    unpack them there (pip, from PyPI)."""
    import shutil
    import zipfile

    VENDOR.mkdir(exist_ok=True)
    wheels = VENDOR / "wheels"
    cmd = [sys.executable, "-m", "pip", "download", "--only-binary=:all:", "--no-deps"]
    cmd += ["--python-version", "3.12", "--platform", "manylinux2014_x86_64", "-d", str(wheels), *VENDORED]
    subprocess.run(cmd, check=True)
    for wheel in wheels.glob("*.whl"):
        with zipfile.ZipFile(wheel) as z:
            z.extractall(VENDOR)
    shutil.rmtree(wheels)
    print(f"vendored into {VENDOR}: carry it with the check (run's carry: ['bench/gpu_vendor'])")


def print_table(rows: list[dict]) -> None:
    cols = list(rows[0])
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(f"{r[c]:.4g}" if isinstance(r[c], float) else str(r[c]) for c in cols))


COLUMNS = (
    "size",
    "policy",
    "rows",
    "ranks",
    "tokens",
    "step_s",
    "tokens_per_s",
    "peak_gib",
    "bf16_fraction",
    "oom",
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="135m,1b", help="comma-separated: tiny, 135m, 1b")
    ap.add_argument("--batches", default="16,64", help="rows per step, comma-separated")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up")
    ap.add_argument("--out", help="write gpu_learner.json into this folder")
    ap.add_argument("--ingest", help="record a gpu_learner.json from a GPU run (bench/results.py)")
    ap.add_argument("--vendor", action="store_true", help="fill bench/gpu_vendor with pydantic's wheels")
    ap.add_argument("--ranked", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rank-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.sizes = args.size.split(",")
    args.batches = [int(b) for b in args.batches.split(",")]
    if args.vendor:
        return vendor()
    if args.ingest:
        doc = json.loads(Path(args.ingest).read_text())
        from bench.results import record

        record("gpu_learner", f"Learner step on {doc['device']}", doc["rows"], notes=NOTES)
        return None
    if args.ranked:
        return ranked(args)
    import_learner()
    import torch

    from learner.config import Device
    from learner.models.device import resolve

    started = time.perf_counter()
    device = resolve(Device.AUTO)
    rate = bf16_matmul_rate(device)
    rows = []
    for size in args.sizes:
        for policy in ("full", "lora"):
            for batch in args.batches:
                rows.append(measure(size, policy, batch, args, device, rate) | {"ranks": 1})
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    if device.type == "cuda" and torch.cuda.device_count() >= 2:
        rows.append(two_ranks(args))
    rows = [{c: r.get(c) for c in COLUMNS} for r in rows]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"device: {name}; bf16 matmul {rate / 1e12:.1f} TFLOP/s; {time.perf_counter() - started:.0f} s")
    print_table(rows)
    if args.out:
        out = {"device": name, "bf16_tflops": rate / 1e12, "rows": rows}
        Path(args.out, "gpu_learner.json").write_text(json.dumps(out, indent=1))
    return None


def two_ranks(args) -> dict:
    """The full-policy step on 2 GPUs (torchrun, FSDP2); its row."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "row.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__]
        cmd += [
            "--ranked",
            "--rank-out",
            str(out),
            "--size",
            args.sizes[-1],
            "--batches",
            str(args.batches[-1]),
        ]
        cmd += ["--seq", str(args.seq), "--prompt", str(args.prompt), "--steps", str(args.steps)]
        subprocess.run(cmd, check=True, env=os.environ | {"PYTHONPATH": str(ROOT)})
        return json.loads(out.read_text())


NOTES = (
    "Random weights in the SmolLM2 configs (135m; 1b: the 1.7B shape with 16 layers). bf16_fraction: "
    "the step's matmul FLOPs (learner/models/flops.py) per second over the bf16 matmul rate of the same run."
)


if __name__ == "__main__":
    main()
