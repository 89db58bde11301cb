"""Benchmark: one full SAO step vs the sum of the passes it cannot avoid, on the real model.

Usage: ``python bench/bench_sao_step.py [MODEL_DIR] [--batch 8] [--seq 160] [--prompt 32]
[--shared-prefix 0] [--reps 3] [--warmup 1] [--bf16] [--threads N]``. MODEL_DIR defaults to
``var/model``.

With ``--shared-prefix N`` the first N prompt tokens are the same in every row (a deployment's
chat template and system prompt; the demo's is about 80 of 92 prompt tokens), and each repetition
also times the full step with the shared-prefix pass switched off (``learner.algo.prefix``), so the
table shows the two side by side and their ratio.

The required passes of a step with K critic updates are: one policy forward+backward, K critic
forward+backward, and one critic forward (values for the advantage, no grad). Each repetition
times them separately and then one full ``SAOLearner.step`` on the same batch, interleaved so that
load from other processes hits both sides alike; the table reports the median and the minimum of
the repetitions (on a shared machine the minimum is the better estimate of the intrinsic cost).
The ratio step / sum (target <= 1.15) is the overhead of everything else in the step: optimizer
updates, gradient clipping, GAE, DIS statistics and host syncs. Optimizer time is also shown on its
own for reference (not part of the sum).

Memory: peak resident set size (VmHWM from /proc/self/status) of each phase, reset before the
phase by writing 5 to /proc/self/clear_refs (Linux); where that is not allowed, the process-wide
``resource.getrusage(RUSAGE_SELF).ru_maxrss`` (a lifetime peak) is shown instead and labelled so.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.results import record  # noqa: E402
from learner.algo import prefix  # noqa: E402
from learner.algo.critic import ValueModel  # noqa: E402
from learner.algo.metrics import masked_mse  # noqa: E402
from learner.algo.sao import SAOLearner  # noqa: E402
from learner.config import build_config  # noqa: E402
from learner.data.batch import Batch, policy_logprobs  # noqa: E402


class PeakRSS:
    """Peak RSS of a code phase in MiB; see the module docstring for the method."""

    def __init__(self) -> None:
        try:
            self._reset()
            self.method = "VmHWM per phase (clear_refs reset)"
        except OSError:
            self.method = "ru_maxrss (process lifetime peak)"

    @staticmethod
    def _reset() -> None:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")

    def start(self) -> None:
        if self.method.startswith("VmHWM"):
            self._reset()

    def peak_mib(self) -> float:
        if self.method.startswith("VmHWM"):
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) / 1024
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def make_batch(policy, batch: int, seq: int, prompt: int, shared: int = 0, seed: int = 0) -> Batch:
    """Random prompts and responses; rollout log-probs from the policy itself (all ratios 1).

    The first ``shared`` tokens are row 0's in every row."""
    g = torch.Generator().manual_seed(seed)
    vocab = policy.config.vocab_size
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    ids[:, :shared] = ids[0, :shared]
    attn = torch.ones(batch, seq, dtype=torch.long)
    act = torch.zeros(batch, seq)
    act[:, prompt:] = 1
    temps = torch.ones(batch)
    with torch.no_grad():
        rollout = policy_logprobs(policy, ids, attn, temps, positions=act) * act
    rewards = torch.randint(0, 2, (batch,), generator=g).float()
    return Batch(ids, attn, act, rollout, rewards, temps)


def timed(fn: Callable[[], None], mem: PeakRSS) -> tuple[float, float]:
    mem.start()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0, mem.peak_mib()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir", nargs="?", default="var/model")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=160)
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens per row; the rest are actions")
    ap.add_argument("--shared-prefix", type=int, default=0, help="leading prompt tokens common to all rows")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast (master weights stay float32)")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads > 0:
        # On a machine shared with other work, fewer threads than cores avoids the stalls of
        # OpenMP barriers waiting for a descheduled thread, which make timings erratic.
        torch.set_num_threads(args.threads)

    mem = PeakRSS()
    policy = AutoModelForCausalLM.from_pretrained(str(Path(args.model_dir)), dtype=torch.float32)
    critic = ValueModel.from_policy(policy, trainable="mlp", dtype=torch.float32)
    cfg = build_config("paper", overrides={"autocast_bf16": args.bf16})  # the paper's learning rates
    learner = SAOLearner(cfg, policy, critic)
    if not 0 <= args.shared_prefix <= args.prompt:
        ap.error(f"--shared-prefix must be in [0, --prompt={args.prompt}], got {args.shared_prefix}")
    batch = make_batch(policy, args.batch, args.seq, args.prompt, args.shared_prefix)
    mask = batch.action_mask.bool()
    returns = batch.token_rewards().sum(dim=1, keepdim=True).expand_as(batch.action_mask)
    advantages = torch.where(mask, returns - 0.5, 0.0)
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if args.bf16 else nullcontext

    def policy_pass() -> None:
        with autocast():
            lp = policy_logprobs(policy, batch.input_ids, batch.attention_mask, batch.temperatures, mask)
        (-(lp * advantages).sum() / mask.sum()).backward()

    def critic_pass() -> None:
        with autocast():
            v = critic(batch.input_ids, batch.attention_mask)
        masked_mse(v, returns, mask).backward()

    def critic_fwd() -> None:
        with torch.no_grad(), autocast():
            critic(batch.input_ids, batch.attention_mask)

    def optimizer_steps() -> None:
        learner.policy_opt.step()
        for _ in range(cfg.algorithm.critic_updates):
            learner.critic_opt.step()

    default_min_shared = prefix.MIN_SHARED_TOKENS
    rows: dict[str, list[tuple[float, float]]] = {}
    for rep in range(args.warmup + args.reps):
        sample = {}
        learner.policy_opt.zero_grad(set_to_none=True)
        learner.critic_opt.zero_grad(set_to_none=True)
        sample["policy fwd+bwd"] = timed(policy_pass, mem)
        for k in range(cfg.algorithm.critic_updates):
            learner.critic_opt.zero_grad(set_to_none=True)
            sample[f"critic fwd+bwd #{k + 1}"] = timed(critic_pass, mem)
        sample["critic fwd (no grad)"] = timed(critic_fwd, mem)
        # Gradients exist from the passes above, so the optimizers do their full work here.
        sample["optimizer steps (not in sum)"] = timed(optimizer_steps, mem)
        learner.policy_opt.zero_grad(set_to_none=True)
        learner.critic_opt.zero_grad(set_to_none=True)
        sample["full SAO step"] = timed(lambda: learner.step(batch), mem)
        if args.shared_prefix:
            prefix.MIN_SHARED_TOKENS = args.seq + 1  # off: every row runs its whole sequence
            try:
                sample["full SAO step, prefix not shared"] = timed(lambda: learner.step(batch), mem)
            finally:
                prefix.MIN_SHARED_TOKENS = default_min_shared
        print(f"rep {rep + 1}/{args.warmup + args.reps} done", file=sys.stderr, flush=True)
        if rep >= args.warmup:
            for name, value in sample.items():
                rows.setdefault(name, []).append(value)

    tokens = int(batch.attention_mask.sum())
    med = {name: statistics.median(t for t, _ in vals) for name, vals in rows.items()}
    low = {name: min(t for t, _ in vals) for name, vals in rows.items()}
    peak = {name: max(m for _, m in vals) for name, vals in rows.items()}
    pass_names = [n for n in med if n.startswith(("policy", "critic"))]
    total, total_low = sum(med[n] for n in pass_names), sum(low[n] for n in pass_names)
    step, step_low = med["full SAO step"], low["full SAO step"]

    print(
        f"model={args.model_dir} batch={args.batch}x{args.seq} (prompt {args.prompt}, "
        f"shared prefix {args.shared_prefix}, "
        f"actions {args.seq - args.prompt}) tokens={tokens} K={cfg.algorithm.critic_updates} "
        f"autocast_bf16={args.bf16} threads={torch.get_num_threads()} reps={args.reps} "
        f"warmup={args.warmup}"
    )
    print(f"memory: {mem.method}")
    print(f"{'phase':<30} {'median s':>9} {'min s':>9} {'tokens/s':>10} {'peak RSS MiB':>13}")
    for name in [*pass_names, "optimizer steps (not in sum)"]:
        print(
            f"{name:<30} {med[name]:>9.3f} {low[name]:>9.3f} {tokens / med[name]:>10.1f} {peak[name]:>13.0f}"
        )
    print(f"{'sum of required passes':<30} {total:>9.3f} {total_low:>9.3f} {tokens / total:>10.1f} {'':>13}")
    print(
        f"{'full SAO step':<30} {step:>9.3f} {step_low:>9.3f} {tokens / step:>10.1f} "
        f"{peak['full SAO step']:>13.0f}"
    )
    print(f"ratio step / sum = {step / total:.3f} (median), {step_low / total_low:.3f} (min); target <= 1.15")
    if args.shared_prefix:
        name = "full SAO step, prefix not shared"
        print(
            f"{name:<30} {med[name]:>9.3f} {low[name]:>9.3f} {tokens / med[name]:>10.1f} {peak[name]:>13.0f}"
        )
        print(
            f"ratio shared / not shared = {step / med[name]:.3f} (median), {step_low / low[name]:.3f} (min)"
        )
    print("tokens/s column: from the median time")
    names = [*pass_names, "optimizer steps (not in sum)", "full SAO step"]
    if args.shared_prefix:
        names.append("full SAO step, prefix not shared")
    table = [
        {
            "phase": n,
            "median s": round(med[n], 3),
            "min s": round(low[n], 3),
            "tokens/s": round(tokens / med[n], 1),
            "peak RSS MiB": round(peak[n]),
        }
        for n in names
    ]
    table.append(
        {
            "phase": "step / sum of required passes",
            "median s": round(step / total, 3),
            "min s": round(step_low / total_low, 3),
            "tokens/s": "",
            "peak RSS MiB": "",
        }
    )
    record(
        "sao_step_shared_prefix" if args.shared_prefix else "sao_step",
        "One SAO step against the sum of its passes" + (", shared prefix" if args.shared_prefix else ""),
        table,
        notes=(
            f"Batch {args.batch} × {args.seq} tokens (prompt {args.prompt}, shared prefix {args.shared_prefix}), "
            f"K = {cfg.algorithm.critic_updates}, autocast_bf16 {args.bf16}, {torch.get_num_threads()} threads, "
            f"{args.reps} timed reps after {args.warmup} warm-up; memory: {mem.method}. The last row is "
            "the step over the sum of its required passes (target ≤ 1.15); its columns are ratios."
        ),
    )


if __name__ == "__main__":
    main()
