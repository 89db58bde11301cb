"""Benchmark: the learner step on 1 rank against 2 gloo ranks (FSDP2, ``learner.models.placement``).

Usage: ``flock /tmp/saoserve-engine.lock .venv/bin/python bench/bench_sharded_learner.py
[MODEL_DIR | tiny] [--precision fp32|bf16] [--variants sao,lora,spo] [--batch 8] [--seq 96]
[--prompt 64] [--steps 2] [--rounds 2] [--no-record]``. MODEL_DIR defaults to ``var/model`` (the
135M model); ``tiny`` is a random 2-layer Llama (CI runs it so, tests/integration/
test_sharded_step.py). Each (precision, ranks) run is its own ``torchrun --standalone`` launch;
rounds interleave them (1 rank, 2 ranks, 1 rank, …) so load from other processes hits them alike.

Per variant (``sao``: critic K = 2 and the KL anchor; ``lora``: SAO with a rank-8 adapter;
``spo``: SPO++), every run builds the learner from the same weights and steps it on the same
batches (``bench_sao_step.make_batch``, rows sharing a prompt prefix):

- **equivalence** of the first step, 2 ranks against 1 (with the KL anchor also the no-grad
  ``reference_kl`` measure after it, a metric like the others): the largest difference of any metric
  (absolute and relative to the metric) and of the trained weights (policy, and the critic's
  trained ones), as the largest per-tensor ‖Δw‖/‖w‖ and the largest |Δw| in units of the policy's
  learning rate. fp32 targets: metrics within 1e-5, weights within 1e-6 relative. bf16 (``--precision
  bf16``, one rank in ``MixedPrecisionAdamW``, two in FSDP mixed precision), the bound derived:
  both bf16 steps are roundings of the same float32 step, each about as far from it as the same
  run's one-rank bf16 step is from its float32 one (the ``bf16 noise`` column), so a metric may
  differ by at most twice that; Adam's first update has magnitude at most lr per element, so a
  weight may differ by at most 2·lr (a gradient whose sign bf16 rounding flips);
- **step time** (median over ``--steps`` steps after the first, and rounds) and tokens/s, each
  rank with ``--threads`` torch threads (1: one rank does all rows on one core, two ranks half the
  rows each on one core each, so 0.5 would be perfect scaling; on this shared 2-core machine the
  two ranks also compete with whatever else runs, so the figure is for correctness, not speed);
- **memory per rank**: the state (the rank's shards of parameters and optimiser moments, by
  accounting) and the peak resident set during the timed steps (VmHWM after a reset,
  ``bench_sao_step.PeakRSS``);
- **collectives**: the summed duration of the gloo operations in one profiled step (all-gathers of
  parameters and of the rows' logprobs and values, reduce-scatters of gradients, the norm's
  all-reduce), in ms and as a share of that step's time (they overlap compute in part).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_sao_step import PeakRSS, make_batch  # noqa: E402
from results import record  # noqa: E402

VARIANTS = {
    "sao": {"algorithm": {"name": "sao", "kl_coef": 0.04, "critic_updates": 2}},
    "lora": {"algorithm": {"name": "sao", "kl_coef": 0.04}, "policy": {"kind": "lora", "rank": 8}},
    "spo": {"algorithm": {"name": "spo"}},
}
TIMING_KEYS = ("time", "per_s", "started_at", "switch_s")


def model_name(source: str) -> str:
    """How a table names the model: ``tiny``, or the folder's config name (e.g. SmolLM2-135M)."""
    if source == "tiny":
        return "tiny (random, 2 layers, hidden 32)"
    config = json.loads(Path(source, "config.json").read_text())
    return config.get("_model_name_or_path") or Path(source).name


def load_model(source: str):
    """A float32 causal LM: the folder ``source``, or the random 2-layer Llama for ``tiny``."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if source == "tiny":
        torch.manual_seed(0)
        shape = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
        cfg = LlamaConfig(vocab_size=256, num_key_value_heads=2, tie_word_embeddings=True, **shape)
        return LlamaForCausalLM(cfg).float()
    return AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)


def _local_bytes(tensors) -> int:
    from torch.distributed.tensor import DTensor

    total = 0
    for t in tensors:
        t = t.to_local() if isinstance(t, DTensor) else t
        total += t.numel() * t.element_size()
    return total


def state_mib(algorithm) -> float:
    """This rank's parameters (every model it holds, shared storage once) and optimiser state."""
    seen, params = set(), []
    models = [algorithm.policy, getattr(algorithm, "critic", None)]
    models += (
        [algorithm.policy_update.models()[0]]
        if getattr(algorithm, "policy_update", None) and algorithm.policy_update.models()
        else []
    )
    for model in models:
        for p in model.parameters() if model is not None else ():
            if id(p) not in seen:
                seen.add(id(p))
                params.append(p)
    opts = [algorithm.policy_opt, getattr(algorithm, "critic_opt", None)]
    moments = [
        v for o in opts if o is not None for s in o.state.values() for v in s.values() if torch.is_tensor(v)
    ]
    return (_local_bytes(params) + _local_bytes(moments)) / 2**20


def trained_weights(algorithm) -> dict[str, torch.Tensor]:
    """The trained tensors of the policy and the critic, whole (every rank takes part), as the
    optimiser holds them: float32 masters in bf16 (``MixedPrecisionAdamW``'s on one rank, FSDP's
    sharded float32 parameters on two), the parameters themselves in float32."""
    from learner.models.placement import full_tensor
    from learner.models.precision import MixedPrecisionAdamW

    out = {}
    pairs = [("policy", algorithm.policy, algorithm.policy_opt)]
    if getattr(algorithm, "critic", None) is not None:
        pairs.append(("critic", algorithm.critic, algorithm.critic_opt))
    for prefix, model, opt in pairs:
        if isinstance(opt, MixedPrecisionAdamW):
            named = opt.master.state_dict().items()
        else:
            named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        for name, p in named:
            # A copy: in one process the parameter itself would come back, and move on.
            out[f"{prefix}.{name}"] = full_tensor(p.detach()).float().clone()
    return out


def comm_ms(step, batch) -> float:
    """The summed duration (ms) of the gloo operations during ``step(batch)``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step(batch)
    return sum(e.cpu_time_total for e in prof.events() if e.name.startswith("gloo:")) / 1e3


def worker(args) -> None:
    """One (precision, ranks) run under torchrun: every variant, first step kept for equivalence."""
    import torch.distributed as dist

    from learner.algo.registry import build_algorithm
    from learner.config import LearnerConfig
    from learner.models.placement import Placement

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    placement = Placement(torch.device("cpu"), rank, world, bf16=args.precision == "bf16")
    template = load_model(args.model)
    batches = [
        make_batch(template, args.batch, args.seq, args.prompt, shared=args.prompt - 8, seed=s)
        for s in range(args.steps + 2)
    ]
    for b in batches:
        b.token_staleness = torch.zeros_like(b.input_ids)
        b.baseline_values = torch.full((args.batch,), 0.5)
        b.rollout_logprobs = b.rollout_logprobs - 0.05 * b.action_mask  # ratios near, not at, 1
    out = {"rank": rank, "world": world, "variants": {}}
    weights = {}
    for name in args.variants:
        config = LearnerConfig(
            batch_size=args.batch, device="cpu", bf16=args.precision == "bf16", **VARIANTS[name]
        )

        def load_policy():
            torch.manual_seed(0)
            model = load_model(args.model)
            return model

        algorithm = build_algorithm(config, load_policy, placement)
        algorithm.on_version(0)
        first = algorithm.step(batches[0])
        if config.has_kl_anchor:
            # The guard's no-grad measure of the stepped policy's KL to the base on a batch it
            # has not trained on (the drift veto's, docs/guard.md): every rank takes part.
            first = first | {"reference_kl": algorithm.reference_kl(batches[1])}
        weights[name] = trained_weights(algorithm)
        mem = PeakRSS()
        times, m, peak, collective, profiled = [], first, 0.0, 0.0, 0.0
        for i in range(args.steps):
            mem.start()
            t0 = time.perf_counter()
            m = algorithm.step(batches[1 + i])
            times.append(time.perf_counter() - t0)
            peak = mem.peak_mib()
        if args.steps:
            t0 = time.perf_counter()
            collective = comm_ms(algorithm.step, batches[-1])
            profiled = time.perf_counter() - t0
        out["variants"][name] = {
            "metrics": {
                k: v
                for k, v in first.items()
                if isinstance(v, float) and not any(s in k for s in TIMING_KEYS)
            },
            "step_s": times,
            "tokens": m["tokens"],
            "state_mib": state_mib(algorithm),
            "peak_mib": peak,
            "comm_ms": collective,
            "profiled_s": profiled,
            "lr": config.policy_lr,
        }
        del algorithm
        if rank == 0:
            done = out["variants"][name]
            print(f"[{args.precision}, {world} rank(s)] {name}: steps {done['step_s']} s", flush=True)
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(out))
    if rank == 0:
        torch.save(weights, Path(args.out, "weights.pt"))
    dist.destroy_process_group()


def launch(args, precision: str, world: int, out: Path) -> dict:
    """One torchrun run; its ranks' JSON and rank 0's weights."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]
    cmd += [__file__, args.model, "--worker", "--out", str(out), "--precision", precision]
    cmd += ["--variants", ",".join(args.variants), "--batch", str(args.batch), "--seq", str(args.seq)]
    cmd += ["--prompt", str(args.prompt), "--steps", str(args.steps)]
    env = os.environ | {
        "OMP_NUM_THREADS": str(getattr(args, "threads", 1)),
        "PYTHONPATH": str(Path(__file__).resolve().parent.parent),
    }
    subprocess.run(cmd, check=True, env=env)
    ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]
    return {"ranks": ranks, "weights": torch.load(Path(out, "weights.pt"), weights_only=False)}


def compare(one: dict, two: dict, name: str) -> dict:
    """Largest metric and weight differences of variant ``name`` between two runs."""
    m1, m2 = one["ranks"][0]["variants"][name]["metrics"], two["ranks"][0]["variants"][name]["metrics"]
    lr = one["ranks"][0]["variants"][name]["lr"]
    abs_diff = max((abs(m1[k] - m2[k]) for k in m1), default=0.0)
    rel_diff = max((abs(m1[k] - m2[k]) / max(abs(m1[k]), 1e-12) for k in m1), default=0.0)
    w1, w2 = one["weights"][name], two["weights"][name]
    rel_w = max(((w1[k] - w2[k]).norm() / w1[k].norm().clamp(min=1e-30)).item() for k in w1)
    max_w = max((w1[k] - w2[k]).abs().max().item() for k in w1)
    changed = sum(int((w1[k] != w2[k]).sum()) for k in w1) / sum(w.numel() for w in w1.values())
    return {
        "metric_abs": abs_diff,
        "metric_rel": rel_diff,
        "weight_rel": rel_w,
        "weight_lr": max_w / lr,
        "changed": changed,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="var/model")
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--variants", default="sao,lora,spo")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=96)
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens per row; the rest are actions")
    ap.add_argument("--steps", type=int, default=2, help="timed steps after the first (0: equivalence only)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--no-record", action="store_true", help="print only (CI's tiny run)")
    ap.add_argument("--record-name", help="the result's name (default: sharded_learner_<precision>)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(args.variants) - set(VARIANTS))
    if unknown:
        ap.error(f"unknown variants {unknown}: choose from {', '.join(VARIANTS)}")
    if args.worker:
        worker(args)
        return
    runs: dict[tuple[str, int], list[dict]] = {}
    plan = [("fp32", 1), ("fp32", 2)] if args.precision == "fp32" else [("fp32", 1), ("bf16", 1), ("bf16", 2)]
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for precision, world in plan:
                runs.setdefault((precision, world), []).append(
                    launch(args, precision, world, Path(tmp, f"{precision}-{world}-{r}"))
                )
    rows = table(args, runs)
    print_table(rows)
    if not args.no_record:
        record(
            args.record_name or f"sharded_learner_{args.precision}",
            f"Learner step, 1 rank vs 2 gloo ranks (FSDP2), {args.precision}, model {model_name(args.model)}",
            rows,
            notes=NOTES[args.precision],
        )


NOTES = {
    "fp32": (
        "Equivalence of the first step (2 ranks vs 1; targets: metrics within 1e-5, weights within "
        "1e-6 relative); time and memory per rank, one torch thread per rank on the shared 2-core "
        "machine (for correctness, not speed). collectives: summed gloo operation time in one "
        "profiled step."
    ),
    "bf16": (
        "bf16: one rank with float32 masters (MixedPrecisionAdamW), two with FSDP mixed precision. "
        "Bound: a metric may differ by at most twice the bf16 noise (|bf16 - fp32| on one rank, same "
        "run: both bf16 steps round the same float32 step), a weight by at most 2 lr (Adam's first "
        "update is at most lr per element)."
    ),
}


def within_bf16_bound(eq: dict, noise: dict) -> bool:
    """The bf16 bound (module docstring): both bf16 steps are roundings of the same float32 step,
    each as far from it as bf16 takes the one-rank step (``noise``), so they differ by at most
    twice that; a weight by at most 2·lr (a flipped sign of Adam's first update), to float
    rounding of lr."""
    return eq["metric_abs"] <= 2 * noise["metric_abs"] and eq["weight_lr"] <= 2.0 * (1 + 1e-3)


def table(args, runs) -> list[dict]:
    rows = []
    precision = args.precision
    base = runs[(precision, 1)]
    sharded = runs[(precision, 2)]
    for name in args.variants:
        eq = compare(base[0], sharded[0], name)
        noise = compare(runs[("fp32", 1)][0], base[0], name) if precision == "bf16" else None
        t1 = statistics.median(t for run in base for t in run["ranks"][0]["variants"][name]["step_s"])
        t2 = statistics.median(t for run in sharded for t in run["ranks"][0]["variants"][name]["step_s"])
        v1, v2 = base[0]["ranks"][0]["variants"][name], [r["variants"][name] for r in sharded[0]["ranks"]]
        tokens = v1["tokens"]
        row = {
            "variant": name,
            "metric max abs diff": eq["metric_abs"],
            "metric max rel": eq["metric_rel"],
            "weight max rel": eq["weight_rel"],
            "weight max diff / lr": eq["weight_lr"],
        }
        if noise is not None:
            row["bf16 noise (abs)"] = noise["metric_abs"]
            row["within bound"] = within_bf16_bound(eq, noise)
        else:
            row["within target"] = eq["metric_abs"] <= 1e-5 and eq["weight_rel"] <= 1e-6
        row |= {
            "1 rank s": t1,
            "2 ranks s": t2,
            "time 2/1": t2 / t1,
            "tokens/s 1": tokens / t1,
            "state MiB 1": v1["state_mib"],
            "state MiB/rank 2": max(v["state_mib"] for v in v2),
            "peak MiB 1": v1["peak_mib"],
            "peak MiB/rank 2": max(v["peak_mib"] for v in v2),
            "collectives ms": max(v["comm_ms"] for v in v2),
            "collectives share": max(v["comm_ms"] / 1e3 / v["profiled_s"] for v in v2),
        }
        rows.append(row)
    return rows


def print_table(rows: list[dict]) -> None:
    cols = list(rows[0])
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(f"{r[c]:.3g}" if isinstance(r[c], float) else str(r[c]) for c in cols))


if __name__ == "__main__":
    main()
