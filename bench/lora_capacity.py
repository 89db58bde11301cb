"""Could a rank-r adapter hold what full fine-tuning learned in the demo? (issue 39, item 4)

Usage: ``python bench/lora_capacity.py BASE_DIR FULL_VERSION_DIR [--checkpoint CHECKPOINT]
[--ranks 1,8,64] [--n 192] [--lora ADAPTER_DIR]``. BASE_DIR: the prepared base model (``saoserve
prepare-model``, the demo's ``run-sao/model``); FULL_VERSION_DIR: a full-weights version a demo
learner published (``saoserve demo --keep-weights``: ``run-sao/policies/v000029``); CHECKPOINT: that
learner's ``checkpoint.pt`` at the same version, whose float32 masters then stand for the version
(a bf16 version's ΔW carries the rounding of every weight it changed, noise spread over the whole
spectrum); ADAPTER_DIR: optionally a LoRA learner's version of the same schedule, for its update's
size beside the full one's.

The update of full fine-tuning, ΔW = W_version − W_base, is split as a LoRA adapter would see it:

1. **Spectrum.** For each of the seven projections a LoRA adapter targets (every layer), the share
   of ‖ΔW‖²_F in its top-r singular values, and ‖ΔW‖_F / ‖W‖_F; the median over the layers per
   projection. A share near 1 at r = 8 says a rank-8 adapter could hold the update; an update
   spread over the whole spectrum says it could not.
2. **Style shares.** The served policy's share of each offered style, ``--n`` answers to the
   simulation's writing requests with the demo's system prompt (vLLM in the serving dtype,
   temperature 1, the offline judge), for: the base; the full version; the base with only the
   projections' ΔW (what an adapter on all seven projections could express at any rank: the
   embeddings and norms stay the base's); and that ΔW cut to its top-r singular directions per
   projection, for each of ``--ranks``. If the rank-8 cut keeps the full version's share of the
   target style, the rank does not limit LoRA in the demo.

Each policy is served in float32 (so a cut update is served as computed, not rounded to bf16's
spacing) by its own vLLM engine in a subprocess (one engine per process), one after the other;
each answer has a seed of its own. Records ``lora_capacity_spectrum`` and
``lora_capacity_shares`` (bench/results.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
STYLES = ("pirate", "poetic")  # the demo's offered styles (saoserve.run_options.DEMO_SCHEDULE)
WEIGHTS = "model.safetensors"
ADAPTER = "adapter_model.safetensors"


def projection_of(name: str) -> str | None:
    """The projection a weight's name ends in (``model.layers.3.mlp.up_proj.weight`` → up_proj)."""
    parts = name.split(".")
    return parts[-2] if len(parts) >= 2 and parts[-2] in PROJECTIONS and parts[-1] == "weight" else None


def spectrum(base: dict, version: dict, ranks: list[int]) -> list[dict]:
    """Per projection: median over layers of ‖ΔW‖_F/‖W‖_F and of the energy share in the top-r."""
    import torch

    by: dict[str, list[dict]] = {p: [] for p in PROJECTIONS}
    for name, w in base.items():
        proj = projection_of(name)
        if proj is None:
            continue
        delta = version[name].float() - w.float()
        s = torch.linalg.svdvals(delta)
        energy = (s**2).cumsum(0) / (s**2).sum()
        row = {"rel": (delta.norm() / w.float().norm()).item()}
        row |= {f"top{r}": energy[min(r, len(s)) - 1].item() for r in ranks}
        by[proj].append(row)
    out = []
    for proj, rows in by.items():
        line = {"projection": proj, "layers": len(rows)}
        line["|ΔW|/|W|"] = round(statistics.median(r["rel"] for r in rows), 5)
        line |= {f"energy in top {r}": round(statistics.median(x[f"top{r}"] for x in rows), 3) for r in ranks}
        out.append(line)
    return out


def truncated(base: dict, version: dict, rank: int | None, dtype) -> dict:
    """The base with each projection's ΔW (cut to its top ``rank`` singular directions; None:
    all of it) added, every other tensor the base's; in ``dtype``."""
    import torch

    out = {}
    for name, w in base.items():
        if projection_of(name) is None:
            out[name] = w.to(dtype).contiguous()
            continue
        delta = version[name].float() - w.float()
        if rank is not None:
            u, s, vh = torch.linalg.svd(delta, full_matrices=False)
            delta = (u[:, :rank] * s[:rank]) @ vh[:rank]
        out[name] = (w.float() + delta).to(dtype).contiguous()
    return out


def write_folder(base_dir: Path, weights: dict, out: Path) -> Path:
    """A servable model folder: ``weights`` and the base's config and tokenizer files."""
    from safetensors.torch import save_file

    out.mkdir(parents=True)
    save_file(weights, out / WEIGHTS, metadata={"format": "pt"})
    for f in base_dir.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy2(f, out / f.name)
    return out


def shares(folder: Path, out: Path, n: int, seed: int, max_tokens: int) -> dict:
    """Run ``--eval`` in a subprocess (one vLLM engine per process), which writes the shares to
    ``out``, and return them. Raises RuntimeError with the subprocess's last output when it fails."""
    cmd = [sys.executable, __file__, "--eval", str(folder), "--n", str(n), "--seed", str(seed)]
    cmd += ["--max-tokens", str(max_tokens), "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"evaluating {folder} failed:\n{(done.stdout + done.stderr)[-3000:]}")
    return json.loads(out.read_text())


def evaluate(folder: Path, n: int, seed: int, max_tokens: int, out: Path) -> None:
    """Write the style shares of the model in ``folder`` to ``out`` (the subprocess side)."""
    import random

    from vllm import LLM, SamplingParams

    from core.settings import get_settings
    from judge.offline import OfflineJudge
    from judge.styles import system_prompt, writing_requests

    settings = get_settings()
    llm = LLM(
        model=str(folder),
        dtype="float32",
        enforce_eager=True,
        max_model_len=settings.max_model_len,
        kv_cache_memory_bytes=int(settings.kv_cache_gib * (1 << 30)),
        seed=seed,
        enable_chunked_prefill=False,  # as the server: seeded requests crash chunked prefills on CPU
    )
    rng = random.Random(seed)
    picked = [rng.choice(writing_requests()) for _ in range(n)]
    system = system_prompt(list(STYLES))
    chats = [[{"role": "system", "content": system}, {"role": "user", "content": r}] for r in picked]
    # A seed per answer: a request drawn twice gets two samples, not one answer twice.
    params = [
        SamplingParams(temperature=1.0, top_p=1.0, max_tokens=max_tokens, seed=seed * n + i) for i in range(n)
    ]
    outs = llm.chat(chats, params, use_tqdm=False)
    answers = [o.outputs[0].text for o in outs]
    verdicts = OfflineJudge().judge_many([(r, a, STYLES[1]) for r, a in zip(picked, answers, strict=True)])
    counts = Counter(v.style for v in verdicts)
    out.write_text(json.dumps({s: counts.get(s, 0) / n for s in STYLES} | {"n": n}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("base", type=Path, nargs="?")
    parser.add_argument("version", type=Path, nargs="?")
    parser.add_argument("--ranks", default="1,8,64")
    parser.add_argument("--n", type=int, default=192, help="Answers per policy.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument(
        "--lora", type=Path, help="A LoRA version folder: its update's size beside the full one's."
    )
    parser.add_argument(
        "--checkpoint", type=Path, help="The learner's checkpoint.pt at FULL_VERSION_DIR's version."
    )
    parser.add_argument("--eval", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.eval is not None:
        evaluate(args.eval, args.n, args.seed, args.max_tokens, args.out)
        return
    if args.base is None or args.version is None:
        parser.error("give BASE_DIR and FULL_VERSION_DIR")
    import torch
    from safetensors.torch import load_file

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from results import record

    ranks = [int(r) for r in args.ranks.split(",")]
    base = load_file(args.base / WEIGHTS)
    version = load_file(args.version / WEIGHTS)
    if args.checkpoint is not None:
        version |= masters(args.checkpoint)
    rows = spectrum(base, version, ranks)
    if args.lora is not None:
        lora_rel = lora_sizes(base, args.lora)
        for row in rows:
            row["LoRA |ΔW|/|W|"] = round(lora_rel[row["projection"]], 5)
    print("| " + " | ".join(rows[0]) + " |")
    for row in rows:
        print("| " + " | ".join(str(v) for v in row.values()) + " |")
    record(
        "lora_capacity_spectrum",
        "Full fine-tuning's update in the demo: its size and the share of it in the top-r singular directions",
        rows,
        notes="Medians over the 30 layers per projection; ΔW = the version (its float32 masters with --checkpoint) − the base.",
    )
    dtype = torch.float32
    policies: list[tuple[str, Path]] = [("base", args.base), ("full version", args.version)]
    with tempfile.TemporaryDirectory() as tmp:
        for rank in [None, *sorted(ranks, reverse=True)]:
            label = "projections' ΔW, all ranks" if rank is None else f"projections' ΔW, top {rank}"
            folder = write_folder(args.base, truncated(base, version, rank, dtype), Path(tmp) / f"r{rank}")
            policies.append((label, folder))
        table = []
        for k, (label, folder) in enumerate(policies):
            got = shares(folder, Path(tmp) / f"shares-{k}.json", args.n, args.seed, args.max_tokens)
            table.append(
                {"policy": label} | {f"{s} share": round(got[s], 3) for s in STYLES} | {"answers": got["n"]}
            )
            print(table[-1], flush=True)
    record(
        "lora_capacity_shares",
        "The demo's full-weights policy and its update cut to rank r: style shares of the served answers",
        table,
        notes="poetic is the target after the demo's switch; the base's shares are the starting point.",
    )


def masters(checkpoint: Path) -> dict:
    """The float32 masters of a bf16 learner's policy in ``checkpoint`` (``checkpoint.pt``: the
    policy optimizer's ``master``, by the model's parameter names). Raises KeyError when the
    checkpoint has none (a float32 learner: its version file is already exact)."""
    import torch

    state = torch.load(checkpoint, map_location="cpu", weights_only=False)
    print(f"masters of version {state['version']} from {checkpoint}")
    return dict(state["learner"]["policy_optimizer"]["master"])


def lora_sizes(base: dict, folder: Path) -> dict[str, float]:
    """Median ‖s·B·A‖_F/‖W‖_F per projection of the adapter in ``folder`` (PEFT's layout)."""
    from safetensors.torch import load_file

    config = json.loads((folder / "adapter_config.json").read_text())
    r, alpha = config["r"], config["lora_alpha"]
    scale = alpha / r**0.5 if config.get("use_rslora") else alpha / r
    lora = load_file(folder / ADAPTER)
    by: dict[str, list[float]] = {p: [] for p in PROJECTIONS}
    for name, w in base.items():
        proj = projection_of(name)
        stem = "base_model.model." + name.removesuffix(".weight")
        if proj is None or f"{stem}.lora_A.weight" not in lora:
            continue
        delta = scale * (lora[f"{stem}.lora_B.weight"].float() @ lora[f"{stem}.lora_A.weight"].float())
        by[proj].append((delta.norm() / w.float().norm()).item())
    return {p: statistics.median(v) if v else float("nan") for p, v in by.items()}


if __name__ == "__main__":
    main()
