"""Benchmark: the SAO learner step with a LoRA policy (rank 8, rank 1) against full fine-tuning.

Usage: ``python bench/bench_learner_lora.py [MODEL_DIR] [--batch 16] [--seq 160] [--prompt 32]
[--options bf16-full,bf16-lora8,bf16-lora1,fp32-full,fp32-lora8,fp32-lora1] [--steps 2]
[--warmup 1] [--threads 2]``. MODEL_DIR defaults to ``var/model``. Run it under
``flock /tmp/saoserve-heavy.lock`` (its runs: docs/log/2026-12-06-lora-runs.md).

Each option is ``<precision>-<policy>``: precision ``bf16`` (``LearnerConfig.bf16``: bf16 models,
float32 masters of what is trained) or ``fp32``; policy ``full`` or ``lora<r>`` (a rank-r adapter
on all seven projections, α = 32, ``learner.models.lora``). The step is ``SAOLearner.step`` as
``saoserve learn`` builds it (``SAOLearner.build``) with the ``paper`` preset, K = 2 critic
updates and the KL anchor on (kl_coef 0.05: one reference forward; with LoRA the policy with its
adapter off, no second model), on the random rows of ``bench_sao_step.make_batch``.

Options of one precision are built together and their steps interleaved (A, B, C, then again),
so load from other processes on the shared machine hits them alike; the precisions run one after
the other, each group freed before the next (memory). Reported per option:

- step time: median and minimum over ``--steps`` timed steps, after ``--warmup`` untimed ones;
- trained: parameters the policy optimizer updates;
- state MiB: the learner's tensors by accounting (not sampled): models (policy, critic, an own
  reference; shared storage once), and the optimizer state (AdamW moments and float32 masters of
  policy and critic);
- step peak MiB: the process's peak resident set during the last timed step above its resident set
  just before it (VmHWM after a ``/proc/self/clear_refs`` reset, as ``bench_sao_step.PeakRSS``):
  the step's activations, gradients and temporaries;
- the ratios of time and memory to the ``full`` option of the same precision.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from bench_learner_precision import release_memory
from bench_sao_step import PeakRSS, make_batch
from transformers import AutoModelForCausalLM

from learner.algo.sao import SAOLearner
from learner.config import build_config
from learner.models.precision import MixedPrecisionAdamW

KL_COEF = 0.05
MIB = 1 << 20


def config_of(option: str):
    """The ``LearnerConfig`` of ``option`` (module docstring)."""
    precision, policy = option.split("-", 1)
    fields: dict = {"bf16": precision == "bf16", "algorithm": {"kl_coef": KL_COEF}}
    if policy.startswith("lora"):
        fields["policy"] = {"kind": "lora", "rank": int(policy.removeprefix("lora"))}
    return build_config("paper", overrides=fields)


def _bytes(tensors) -> int:
    """Bytes of the distinct storages among ``tensors``."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _optimizer_tensors(opt) -> list[torch.Tensor]:
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return state + (list(opt.master.params) if isinstance(opt, MixedPrecisionAdamW) else [])


def state_mib(learner: SAOLearner) -> tuple[float, float]:
    """(models, optimizer state) MiB of ``learner``'s tensors (module docstring)."""
    anchor = learner.policy_update.anchor
    models = [learner.policy, learner.critic]
    if anchor is not None and not anchor.shares_policy:
        models.append(anchor.reference)
    weights = _bytes(t for m in models for t in [*m.parameters(), *m.buffers()])
    opt = _bytes(t for o in (learner.policy_opt, learner.critic_opt) for t in _optimizer_tensors(o))
    return weights / MIB, opt / MIB


def trained(learner: SAOLearner) -> int:
    return sum(p.numel() for p in learner.policy_params)


def run_group(options: list[str], model_dir: str, batch, steps: int, warmup: int, mem: PeakRSS) -> dict:
    """Build, warm up and time the learners of ``options`` (interleaved); their figures."""

    def load():
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

    learners = {}
    for option in options:
        learners[option] = SAOLearner.build(config_of(option), load)
        release_memory()
    for learner in learners.values():
        for _ in range(warmup):
            learner.step(batch)
            release_memory()
    times: dict[str, list[float]] = {o: [] for o in options}
    peaks: dict[str, float] = {}
    for rep in range(steps):
        for option, learner in learners.items():
            release_memory()
            before = rss_mib()
            mem.start()
            t0 = time.perf_counter()
            learner.step(batch)
            times[option].append(time.perf_counter() - t0)
            peaks[option] = mem.peak_mib() - before
        print(f"rep {rep + 1}/{steps}: {[round(t[-1], 2) for t in times.values()]}", file=sys.stderr)
    out = {}
    for option, learner in learners.items():
        weights, opt = state_mib(learner)
        out[option] = {
            "median": statistics.median(times[option]),
            "min": min(times[option]),
            "trained": trained(learner),
            "weights": weights,
            "optimizer": opt,
            "peak": peaks[option],
        }
    del learners
    release_memory()
    return out


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir", nargs="?", default="var/model")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=160)
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens per row; the rest are actions")
    ap.add_argument("--options", default="bf16-full,bf16-lora8,bf16-lora1,fp32-full,fp32-lora8,fp32-lora1")
    ap.add_argument("--steps", type=int, default=2, help="timed steps per option")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps per option first")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    options = args.options.split(",")
    for o in options:
        precision, _, policy = o.partition("-")
        if precision not in ("bf16", "fp32") or not (
            policy == "full" or policy.removeprefix("lora").isdigit()
        ):
            ap.error(f"unknown option {o!r}: <bf16|fp32>-<full|lora<rank>>")
    if args.steps < 1 or args.warmup < 0 or not 0 < args.prompt < args.seq:
        ap.error("need --steps >= 1, --warmup >= 0 and 0 < --prompt < --seq")
    model_dir = str(Path(args.model_dir))
    rollout = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    batch = make_batch(rollout, args.batch, args.seq, args.prompt)
    del rollout
    mem = PeakRSS()
    load_before = os.getloadavg()
    results: dict[str, dict] = {}
    for precision in ("bf16", "fp32"):
        group = [o for o in options if o.startswith(precision + "-")]
        if group:
            results |= run_group(group, model_dir, batch, args.steps, args.warmup, mem)
    print(
        f"model={args.model_dir} batch={args.batch}x{args.seq} (prompt {args.prompt}) SAO K=2, KL anchor "
        f"on, threads={torch.get_num_threads()} steps={args.steps} warmup={args.warmup}; load average "
        f"{load_before[0]:.2f} at start, {os.getloadavg()[0]:.2f} at end; memory: {mem.method}"
    )
    print(
        f"{'option':<11} {'median s':>8} {'min s':>6} {'× time':>6} {'trained':>11} {'models MiB':>10} "
        f"{'optim MiB':>9} {'× optim':>7} {'step peak MiB':>13} {'× peak':>6}"
    )
    for option, r in results.items():
        full = results.get(option.split("-")[0] + "-full")

        def ratio(key: str, r=r, full=full) -> str:
            return f"{r[key] / full[key]:.3f}" if full and full[key] else "-"

        print(
            f"{option:<11} {r['median']:>8.2f} {r['min']:>6.2f} {ratio('median'):>6} {r['trained']:>11,} "
            f"{r['weights']:>10.0f} {r['optimizer']:>9.0f} {ratio('optimizer'):>7} {r['peak']:>13.0f} "
            f"{ratio('peak'):>6}"
        )
    print("× columns: the option's figure over the full-fine-tuning option of the same precision")


if __name__ == "__main__":
    main()
