"""Benchmark: N tenant policies' learners in one process on one shared base against one learner
process per policy (issue 39, item 3; docs/tenants.md, "Many tenants in one learner").

Usage: ``python bench/bench_tenant_learners.py [MODEL_DIR] [--policies 1,2,4] [--batch 8]
[--seq 128] [--prompt 32] [--precision auto|bf16|fp32] [--threads 2] [--interleaved N [--reps 2]]
[--record]``. MODEL_DIR defaults
to ``var/model`` (``saoserve prepare-model``). Run it under ``flock /tmp/saoserve-heavy.lock``.

Each measurement is a fresh subprocess (so one's memory does not carry into the next):

- ``shared``, N policies: ``learner.shared_base.SharedBase`` loads the base once and builds N
  learners on it (what ``saoserve learn --tenants`` builds for N policies: each a LoRA adapter,
  an adapter critic and their optimizers), then each takes one untimed and one timed step on the
  same batch, in turn.
- ``alone``: one learner as ``saoserve learn --tenant T`` builds it (``SAOLearner.build``: its
  own float32 base loaded from the folder, the paper's critic on a copy of the body), the same two
  steps. N processes of it hold N times its memory: the rows for N > 1 are N × this one
  measurement, not N processes run at once.

The learner is the ``demo`` preset (bf16 where the CPU computes it natively, else float32;
``--precision`` sets it) with a rank-8 adapter on all seven projections (the LoRA
default), the KL anchor on (the policy with its adapter off, no second model), SAO K = 2, on
``bench_sao_step.make_batch``'s random rows. Reported per row: resident set (VmRSS) after the
steps with freed heap handed back (``release_memory``), the peak (VmHWM) of the whole process,
the resident set above the process's before any model (interpreter and libraries), the learner tensors by
accounting (distinct storages: the shared base once, and each policy's own tensors: adapter,
critic, value head, optimizer moments and float32 masters), and the median time of a policy's
timed step. Those step times come from processes run one after the other; on a machine shared
with other jobs ``--interleaved N`` times them fairly instead (``interleaved``; its own table,
``tenant_learner_steps``).
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

MIB = 1 << 20


def status_mib(field: str) -> float:
    """A ``/proc/self/status`` field (``VmRSS``, ``VmHWM``) in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def storages(tensors) -> dict[int, int]:
    """``{storage address: bytes}`` of the distinct storages among ``tensors``."""
    import torch

    return {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for t in tensors
        if isinstance(t, torch.Tensor)
    }


def learner_storages(learner) -> dict[int, int]:
    """Every storage one learner holds: its models' parameters and buffers and its optimizers'
    state (moments, float32 masters)."""
    from learner.models.precision import MixedPrecisionAdamW

    tensors = []
    for model in (learner.policy, learner.critic):
        tensors += [*model.parameters(), *model.buffers()]
    for opt in (learner.policy_opt, learner.critic_opt):
        tensors += [v for s in opt.state.values() for v in s.values()]
        tensors += list(opt.master.params) if isinstance(opt, MixedPrecisionAdamW) else []
    return storages(tensors)


def overrides(args) -> dict:
    """The fields laid over the ``demo`` preset (module docstring)."""
    fields: dict = {"batch_size": args.batch, "policy": {"kind": "lora", "rank": 8}}
    if args.precision != "auto":
        fields["bf16"] = args.precision == "bf16"
    return fields


def child(mode: str, n: int, args) -> dict:
    """One measurement (module docstring), in this process; its figures."""
    import torch
    from bench_learner_precision import release_memory
    from bench_sao_step import make_batch
    from transformers import AutoModelForCausalLM

    from learner.algo.sao import SAOLearner
    from learner.config import build_config
    from learner.shared_base import SharedBase

    torch.set_num_threads(args.threads)
    release_memory()
    before = status_mib("VmRSS")
    config = build_config("demo", overrides=overrides(args))

    def load():
        return AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)

    if mode == "shared":
        base = SharedBase.load(args.model_dir)
        learners = [base.build(config) for _ in range(n)]
        shared = storages([*base.model.parameters(), *base.model.buffers()])
    else:
        learners = [SAOLearner.build(config, load)]
        shared = {}
    release_memory()
    rollout = load()
    batch = make_batch(rollout, args.batch, args.seq, args.prompt)
    del rollout
    release_memory()
    times = []
    for timed in (False, True):
        for learner in learners:
            t0 = time.perf_counter()
            learner.step(batch)
            if timed:
                times.append(time.perf_counter() - t0)
            release_memory()
    own = [{k: v for k, v in learner_storages(lrn).items() if k not in shared} for lrn in learners]
    return {
        "rss": status_mib("VmRSS"),
        "peak": status_mib("VmHWM"),
        "libraries": before,
        "shared_mib": sum(shared.values()) / MIB,
        "own_mib": statistics.mean(sum(o.values()) for o in own) / MIB,
        "step_s": statistics.median(times),
    }


def interleaved(args) -> list[dict]:
    """Step times only (``--interleaved N``), in this process: one learner as ``--tenant`` builds
    it and N on one shared base take their steps in turn (one untimed each, then ``--reps`` timed
    rounds), so the load of other jobs on a shared machine falls on both alike."""
    import torch
    from bench_learner_precision import release_memory
    from bench_sao_step import make_batch
    from transformers import AutoModelForCausalLM

    from learner.algo.sao import SAOLearner
    from learner.config import build_config
    from learner.shared_base import SharedBase

    torch.set_num_threads(args.threads)
    config = build_config("demo", overrides=overrides(args))

    def load():
        return AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)

    base = SharedBase.load(args.model_dir)
    learners = {"alone": SAOLearner.build(config, load)}
    learners |= {f"shared {i}": base.build(config) for i in range(args.interleaved)}
    batch = make_batch(load(), args.batch, args.seq, args.prompt)
    times: dict[str, list[float]] = {k: [] for k in learners}
    for rep in range(args.reps + 1):
        for name, learner in learners.items():
            release_memory()
            t0 = time.perf_counter()
            learner.step(batch)
            if rep > 0:
                times[name].append(time.perf_counter() - t0)
        print(f"round {rep}: {[round(t[-1], 1) for t in times.values() if t]}", file=sys.stderr)
    shared = [t for k, t in times.items() if k != "alone"]
    return [
        {
            "learner": "a process per policy (the paper's critic)",
            "policies": 1,
            "step s median": round(statistics.median(times["alone"]), 2),
            "step s min": round(min(times["alone"]), 2),
        },
        {
            "learner": "one process, shared base (adapter critic)",
            "policies": args.interleaved,
            "step s median": round(statistics.median(t for ts in shared for t in ts), 2),
            "step s min": round(min(t for ts in shared for t in ts), 2),
        },
    ]


def measure(mode: str, n: int, args) -> dict:
    """``child(mode, n)`` in a fresh subprocess."""
    command = [sys.executable, __file__, args.model_dir, "--child", f"{mode}:{n}"]
    command += ["--batch", str(args.batch), "--seq", str(args.seq), "--prompt", str(args.prompt)]
    command += ["--precision", args.precision, "--threads", str(args.threads)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), os.getcwd()]))
    out = subprocess.run(command, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"{mode}:{n} failed ({out.returncode}): {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir", nargs="?", default="var/model")
    ap.add_argument("--policies", default="1,2,4", help="numbers of policies in one process")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens per row; the rest are actions")
    ap.add_argument(
        "--precision", choices=("auto", "bf16", "fp32"), default="auto", help="auto: the preset's"
    )
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    ap.add_argument("--record", action="store_true", help="write docs/results/tenant_learners.json")
    ap.add_argument(
        "--interleaved", type=int, default=0, help="N: step times only, interleaved in one process"
    )
    ap.add_argument("--reps", type=int, default=2, help="--interleaved: timed rounds")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.interleaved:
        load = os.getloadavg()[0]
        rows = interleaved(args)
        for row in rows:
            print(row)
        if args.record:
            from bench.results import record

            record(
                "tenant_learner_steps",
                "Tenant policies' learners: step time, one alone and N on a shared base, interleaved",
                rows,
                notes=(
                    f"{args.model_dir}, the learner of bench_tenant_learners (demo preset, rank-8 LoRA, "
                    f"SAO K = 2, KL anchor), batch {args.batch} × {args.seq} tokens ({args.prompt} prompt), "
                    f"{args.threads} torch threads, in one process: each round the lone learner, then the N "
                    f"shared ones, one step each; {args.reps} timed rounds after one untimed (load average "
                    f"{load:.1f} at start, a machine shared with other jobs). The shared learners' critic is "
                    "the adapter critic (docs/design.md §5.2), the lone one's the paper's."
                ),
            )
        return
    if args.child:
        mode, n = args.child.split(":")
        print(json.dumps(child(mode, int(n), args)))
        return
    counts = [int(n) for n in args.policies.split(",")]
    from learner.config import build_config

    precision = "bf16" if build_config("demo", overrides=overrides(args)).bf16 else "float32"
    load = os.getloadavg()[0]
    alone = measure("alone", 1, args)
    print("alone", alone, file=sys.stderr)
    rows = []
    for n in counts:
        shared = measure("shared", n, args)
        print(f"shared {n}", shared, file=sys.stderr)
        rows.append(
            {
                "learner": "one process, shared base",
                "policies": n,
                "RSS MiB": round(shared["rss"]),
                "peak MiB": round(shared["peak"]),
                "above libraries MiB": round(shared["rss"] - shared["libraries"]),
                "RSS MiB per policy": round(shared["rss"] / n),
                "base MiB (once)": round(shared["shared_mib"]),
                "own tensors MiB per policy": round(shared["own_mib"], 1),
                "step s per policy": round(shared["step_s"], 2),
            }
        )
        rows.append(
            {
                "learner": "a process per policy" + ("" if n == 1 else " (N × the one measured)"),
                "policies": n,
                "RSS MiB": round(n * alone["rss"]),
                "peak MiB": round(n * alone["peak"]),
                "above libraries MiB": round(n * (alone["rss"] - alone["libraries"])),
                "RSS MiB per policy": round(alone["rss"]),
                "base MiB (once)": 0,
                "own tensors MiB per policy": round(alone["own_mib"], 1),
                "step s per policy": round(alone["step_s"], 2),
            }
        )
    for row in rows:
        print(row)
    notes = (
        f"{args.model_dir}: the learner of the demo preset with a rank-8 LoRA policy, {precision}, "
        f"SAO K = 2, KL anchor on, batch {args.batch} × {args.seq} tokens ({args.prompt} prompt), "
        f"{args.threads} torch threads, each row a fresh process (load average {load:.1f} at start). "
        "RSS after one untimed and one timed step per policy, freed heap handed back; peak: the process's. "
        "A process per policy: N × one process's figures (each also pays the interpreter and libraries, "
        f"{alone['libraries']:.0f} MiB), its critic the paper's (a copy of the body, MLP trained); shared: "
        "one base, each policy's critic an adapter on the MLP projections (docs/design.md §5.2). Own "
        "tensors: adapter, critic (adapter and head, or the copied body), optimizer moments and masters. "
        "Step times: processes run one after the other on a machine shared with other jobs, so they do not "
        "compare across rows; tenant_learner_steps (--interleaved) times them side by side."
    )
    if args.record:
        from bench.results import record

        record(
            "tenant_learners",
            "Tenant policies' learners: one process on a shared base vs a process each",
            rows,
            notes=notes,
        )


if __name__ == "__main__":
    main()
