"""Benchmark: the SAO learner step in each precision against the machine's matmul rates.

Usage: ``python bench/bench_learner_precision.py [MODEL_DIR] [--batch 16] [--seq 160] [--prompt 32]
[--shared-prefix 0] [--options fp32,autocast,bf16] [--steps 2] [--warmup 1] [--threads 2]
[--mm-reps 7] [--profile] [--dnnl]``. MODEL_DIR defaults to ``var/model``.

Precision options (``--options``, comma-separated; each builds a fresh learner from MODEL_DIR):
    - ``fp32``: float32 models (the learner's default).
    - ``autocast``: float32 models under ``torch.autocast`` bf16 (``LearnerConfig.autocast_bf16``).
    - ``bf16``: ``LearnerConfig.bf16``: bf16 models with float32 master weights and AdamW states
      (``learner.models.precision.MixedPrecisionAdamW``; the reference is bf16 too), attention by
      ``learner.models.attention.grouped_attention``.
    - ``bf16-sdpa``: the same with transformers' default attention (torch's SDPA) put back, to
      show what the attention function is worth.
    - ``bf16-compiled``: ``bf16`` plus ``LearnerConfig.compile_layers`` (``learner.models.fused``); the
      compilation happens in the first warm-up step (keep ``--warmup`` >= 1).

All the options' learners are built first and their steps interleaved (option A, option B, …,
then again), so that load from other processes on a shared machine hits them alike; memory: about
4 GiB resident per float32 learner, 3.4 GiB per bf16 one, plus one step's activations (up to
4 GiB at batch 16 in float32; freed memory is handed back to the OS after each step), so run at
most two options at a time on a 24 GiB machine shared with others. Limits: just before each step the script times ``torch.mm`` of two
2048 × 2048 matrices, float32 and bf16, ``--mm-reps`` times each on the same threads; an option's
limit is the median of the medians measured before its steps, so each ratio compares the step
with the matmul rate of the same minutes (the load average is printed too). The step's FLOPs come from the model's config (``learner.models.flops``); the
table gives its time (median and minimum over ``--steps``), its achieved GFLOP/s (from the
median), and that rate divided by the bf16 and by the float32 limit.

``--profile`` runs one more step of each option under ``torch.profiler`` and splits its time by
kind of operator (matmul, attention, casts, other elementwise, optimizer, and the rest: Python and
dispatch). ``--dnnl`` re-runs one bf16 policy forward+backward in a child process with
``ONEDNN_VERBOSE=1`` and counts the oneDNN matmul implementations it dispatched to (AMX kernels are
named ``…amx…``).

The step is ``SAOLearner.step`` with the paper's learning rates, K = 2 critic updates and the KL
anchor on (one forward of the frozen reference), on random rows whose rollout log-probabilities
come from the float32 policy.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import re
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import torch
import torch._inductor.config
from bench_sao_step import make_batch
from transformers import AutoModelForCausalLM, PreTrainedModel

from learner.algo.critic import ValueModel
from learner.algo.sao import SAOLearner
from learner.config import build_config
from learner.data.batch import policy_logprobs
from learner.models import attention
from learner.models.flops import Shape, Tokens, sao_step_flops

OPTIONS = ("fp32", "autocast", "bf16", "bf16-sdpa", "bf16-compiled")
KL_COEF = 0.05

MATMUL = {"aten::mm", "aten::bmm", "aten::addmm", "aten::matmul", "aten::linear", "aten::baddbmm"}
CASTS = {"aten::copy_", "aten::_to_copy", "aten::to"}
OPTIMIZER = {"aten::_fused_adamw_", "aten::_foreach_norm", "aten::linalg_vector_norm", "aten::_foreach_mul_"}
ATTENTION = re.compile(r"scaled_dot_product|_softmax|softmax_backward")
FUSED = re.compile(r"^cpp_fused|^graph_\d+_cpp_fused")


def release_memory() -> None:
    """Hand freed heap memory back to the OS (glibc ``malloc_trim``; a no-op elsewhere): each
    learner's step frees gigabytes of activations that would otherwise stay in the process."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        return


def matmul_rate(dtype: torch.dtype, reps: int, n: int = 2048) -> float:
    """Median GFLOP/s of ``torch.mm`` of two n × n matrices of ``dtype`` (2·n³ FLOPs each)."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    for _ in range(2):
        a @ b
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(times) / 1e9


def limits(reps: int) -> dict[str, float]:
    return {"fp32": matmul_rate(torch.float32, reps), "bf16": matmul_rate(torch.bfloat16, reps)}


def build(option: str, model_dir: str) -> SAOLearner:
    """A fresh learner for ``option`` (module docstring), configured as ``saoserve learn`` would be."""

    def load():
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

    policy = load()
    critic = ValueModel.from_policy(policy, trainable="mlp", dtype=torch.float32)
    fields = {
        "autocast_bf16": option == "autocast",
        "bf16": option.startswith("bf16"),
        "compile_layers": option == "bf16-compiled",
        "algorithm": {"kl_coef": KL_COEF},
    }
    learner = SAOLearner(build_config("paper", overrides=fields), policy, critic, load())
    if option == "bf16-sdpa":
        for model in (learner.policy, learner.critic, learner.policy_update.anchor.reference):
            for sub in model.modules():
                if isinstance(sub, PreTrainedModel):
                    sub.config._attn_implementation = "sdpa"
    return learner


def breakdown(prof, wall: float) -> dict[str, float]:
    """Seconds of a profiled step by kind of operator (self CPU time of the calling thread)."""
    out: Counter = Counter()
    for e in prof.key_averages():
        s = e.self_cpu_time_total / 1e6
        if FUSED.search(e.key):
            out["fused elementwise (inductor)"] += s
            continue
        if not e.key.startswith("aten::"):
            continue
        if e.key in MATMUL:
            out["matmul"] += s
        elif ATTENTION.search(e.key):
            out["attention (sdpa, softmax)"] += s
        elif e.key in CASTS:
            out["casts and copies"] += s
        elif e.key in OPTIMIZER:
            out["optimizer and clip"] += s
        else:
            out["other elementwise"] += s
    out["Python, dispatch, autograd"] = max(0.0, wall - sum(out.values()))
    return dict(out)


def dnnl_probe(model_dir: str, batch: int, seq: int, prompt: int) -> None:
    """One bf16 policy forward+backward (the ``--dnnl`` child: oneDNN verbose output on stdout)."""
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    rows = make_batch(policy, batch, seq, prompt)
    policy.to(torch.bfloat16)
    attention.install(policy)
    mask = rows.action_mask.bool()
    print("DNNL-PROBE-START", flush=True)
    lp = policy_logprobs(policy, rows.input_ids, rows.attention_mask, rows.temperatures, mask)
    lp.sum().backward()


def dnnl_summary(model_dir: str, batch: int, seq: int, prompt: int) -> None:
    env = dict(os.environ, ONEDNN_VERBOSE="1")
    cmd = [sys.executable, __file__, model_dir, "--dnnl-probe", f"--batch={batch}", f"--seq={seq}"]
    out = subprocess.run(cmd + [f"--prompt={prompt}"], env=env, capture_output=True, text=True, check=True)
    lines = out.stdout.split("DNNL-PROBE-START", 1)[-1].splitlines()
    kinds: Counter = Counter()
    for line in lines:
        f = line.split(",")
        if len(f) > 8 and f[2] == "primitive" and f[3] == "exec":
            src = f[8].split()[0] if f[8] else "?"
            kinds[(f[5], f[6], src)] += 1
    print("oneDNN primitives executed in one bf16 policy forward+backward (ONEDNN_VERBOSE=1):")
    for (prim, impl, src), n in kinds.most_common():
        print(f"  {n:>6}  {prim:<10} {impl:<32} {src}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir", nargs="?", default="var/model")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=160)
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens per row; the rest are actions")
    ap.add_argument("--shared-prefix", type=int, default=0, help="leading prompt tokens common to all rows")
    ap.add_argument(
        "--options", default="fp32,autocast,bf16", help=f"comma-separated, of {', '.join(OPTIONS)}"
    )
    ap.add_argument("--steps", type=int, default=2, help="timed steps per option")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps per option first")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    ap.add_argument("--mm-reps", type=int, default=7, help="torch.mm repetitions per limit measurement")
    ap.add_argument("--profile", action="store_true", help="one more profiled step per option")
    ap.add_argument("--dnnl", action="store_true", help="count oneDNN matmul kernels of a bf16 pass")
    ap.add_argument("--dnnl-probe", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    # Name inductor's kernels in the profile (else their time falls into the Python bucket).
    torch._inductor.config.cpp.enable_kernel_profile = args.profile
    if args.dnnl_probe:
        dnnl_probe(args.model_dir, args.batch, args.seq, args.prompt)
        return
    options = args.options.split(",")
    for o in options:
        if o not in OPTIONS:
            ap.error(f"unknown option {o!r}: choose from {', '.join(OPTIONS)}")
    if not 0 <= args.shared_prefix <= args.prompt < args.seq:
        ap.error("need 0 <= --shared-prefix <= --prompt < --seq")
    if args.steps < 1 or args.warmup < 0:
        ap.error("need --steps >= 1 and --warmup >= 0")

    model_dir = str(Path(args.model_dir))
    shape = Shape.of(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).config)
    tokens = Tokens.rows(args.batch, args.seq, args.seq - args.prompt, args.shared_prefix)
    flops = sao_step_flops(shape, tokens, critic_updates=2, critic_trainable="mlp", kl_anchor=True)
    load_before = os.getloadavg()
    results, profiles = {}, {}
    # Rollout log-probabilities from a float32 policy, the same rows for every option.
    rollout = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    batch = make_batch(rollout, args.batch, args.seq, args.prompt, args.shared_prefix)
    del rollout
    learners = {}
    for option in options:
        learners[option] = build(option, model_dir)
        release_memory()
    for learner in learners.values():
        for _ in range(args.warmup):
            learner.step(batch)
            release_memory()
    times: dict[str, list[float]] = {o: [] for o in options}
    rates: dict[str, list[dict[str, float]]] = {o: [] for o in options}
    for rep in range(args.steps):
        # Interleaved, each step just after a measurement of the limits: load from other
        # processes hits every option and its denominators alike.
        for option, learner in learners.items():
            rates[option].append(limits(args.mm_reps))
            t0 = time.perf_counter()
            learner.step(batch)
            times[option].append(time.perf_counter() - t0)
            release_memory()
        print(f"rep {rep + 1}/{args.steps}: {[round(t[-1], 2) for t in times.values()]}", file=sys.stderr)
    for option, learner in learners.items():
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU]) as prof:
                t0 = time.perf_counter()
                learner.step(batch)
                wall = time.perf_counter() - t0
            profiles[option] = (wall, breakdown(prof, wall))
        results[option] = {
            "median": statistics.median(times[option]),
            "min": min(times[option]),
            "fp32": statistics.median(r["fp32"] for r in rates[option]),
            "bf16": statistics.median(r["bf16"] for r in rates[option]),
        }
    del learners
    gc.collect()

    print(
        f"model={args.model_dir} batch={args.batch}x{args.seq} (prompt {args.prompt}, shared prefix "
        f"{args.shared_prefix}) K=2 KL anchor on, threads={torch.get_num_threads()} steps={args.steps} "
        f"warmup={args.warmup}; load average {load_before[0]:.2f} at start, {os.getloadavg()[0]:.2f} at end"
    )
    parts = ", ".join(f"{k} {v / 1e9:.0f}" for k, v in flops.items() if k != "total")
    print(f"step FLOPs (learner.models.flops): {flops['total'] / 1e12:.2f} TFLOP ({parts} GFLOP)")
    head = (
        f"{'option':<10} {'median s':>9} {'min s':>7} {'GFLOP/s':>8} {'fp32 mm':>8} {'bf16 mm':>8} "
        f"{'÷ bf16':>7} {'÷ fp32':>7} {'× fp32 step':>11}"
    )
    print(head)
    base = results.get("fp32", {}).get("median")
    for option, r in results.items():
        rate = flops["total"] / r["median"] / 1e9
        speed = f"{base / r['median']:>11.2f}" if base else f"{'-':>11}"
        print(
            f"{option:<10} {r['median']:>9.2f} {r['min']:>7.2f} {rate:>8.0f} {r['fp32']:>8.0f} "
            f"{r['bf16']:>8.0f} {rate / r['bf16']:>7.3f} {rate / r['fp32']:>7.3f} {speed}"
        )
    print("fp32 mm / bf16 mm: torch.mm 2048² GFLOP/s, median of the medians measured before each step")
    for option, (wall, parts) in profiles.items():
        print(f"profile of one {option} step ({wall:.2f} s under the profiler):")
        for kind, s in sorted(parts.items(), key=lambda kv: -kv[1]):
            print(f"  {kind:<28} {s:>7.2f} s {s / wall:>6.1%}")
    if args.dnnl:
        dnnl_summary(model_dir, args.batch, args.seq, args.prompt)


if __name__ == "__main__":
    main()
