"""A policy version published as a LoRA adapter, on the server's side: the check before it is
served, the server's own copy of its files, and its merge into full weights.

An adapter folder holds PEFT's ``adapter_config.json`` and ``adapter_model.safetensors``
(``core.policy_store``). The server serves only adapters vLLM and the merge both apply exactly:
plain LoRA (no DoRA, no per-module ranks or alphas, no bias, no saved modules) on the linear
projections of the decoder layers, every pair of matrices matching the serving model's weight
(``lora_A`` ``[r, in]``, ``lora_B`` ``[out, r]``), rank at most ``max_lora_rank``. The merged
weight of a module is ``W + scale · B · A`` with ``scale = lora_alpha / r`` (``/ √r`` with
rsLoRA), PEFT's own definition. docs/serving_adapters.md.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

from core.policy_store import ADAPTER_CONFIG, ADAPTER_FILE, WEIGHTS_FILE
from core.weights import WeightsLayout, WeightsMismatch, read_header, weights_sha256

# The projections of a Llama decoder layer that vLLM 0.32 serves LoRA on and PEFT names so.
SUPPORTED_MODULES = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"})
# PEFT's prefix of the wrapped model's tensor names.
PEFT_PREFIX = "base_model.model."
# Options of adapter_config.json that change what the adapter computes; each must be off.
UNSUPPORTED_OPTIONS = ("use_dora", "modules_to_save", "rank_pattern", "alpha_pattern", "layers_to_transform")


class AdapterMismatch(ValueError):
    """An adapter folder cannot be served: unreadable or unsupported config, rank above the
    bound, target modules the model lacks or vLLM cannot serve, tensors of the wrong shape, a
    malformed safetensors file, or a checksum that is not the published one."""


@dataclass(frozen=True)
class AdapterSpec:
    """What an adapter applies: ``rank``, ``scale`` (multiplies B·A) and the base weights it
    changes (``model.layers.0.self_attn.q_proj.weight``, ...)."""

    rank: int
    scale: float
    weights: frozenset[str]


def check_adapter(folder: Path, layout: WeightsLayout, max_rank: int) -> AdapterSpec:
    """The adapter in ``folder``, checked against the serving model's ``layout``.

    Reads the config and the safetensors header only (kB). Raises AdapterMismatch naming what
    is wrong.
    """
    folder = Path(folder)
    try:
        config = json.loads((folder / ADAPTER_CONFIG).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterMismatch(f"cannot read {ADAPTER_CONFIG} of {folder}: {exc}") from exc
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        raise AdapterMismatch(f"{folder} is not a LoRA adapter (peft_type {config.get('peft_type')!r})")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, int | float):
        raise AdapterMismatch(f"{folder}: r {rank!r} and lora_alpha {alpha!r} must be numbers, r >= 1")
    if rank > max_rank:
        raise AdapterMismatch(f"{folder}: rank {rank} is above max_lora_rank {max_rank}")
    on = [k for k in UNSUPPORTED_OPTIONS if config.get(k)]
    if config.get("bias", "none") != "none":
        on.append("bias")
    if on:
        raise AdapterMismatch(f"{folder}: unsupported adapter options set: {', '.join(on)}")
    targets = config.get("target_modules")
    if not isinstance(targets, list) or not targets:
        raise AdapterMismatch(f"{folder}: target_modules must be a list of module names, not {targets!r}")
    unknown = sorted(set(targets) - SUPPORTED_MODULES)
    if unknown:
        raise AdapterMismatch(
            f"{folder}: target modules {unknown} are not served (supported: {sorted(SUPPORTED_MODULES)})"
        )
    try:
        tensors = read_header(folder / ADAPTER_FILE)
    except (OSError, WeightsMismatch) as exc:
        raise AdapterMismatch(f"{folder}: {exc}") from exc
    pairs: dict[str, dict[str, tuple[int, ...]]] = {}
    for name, spec in tensors.items():
        stem, _, kind = name.removeprefix(PEFT_PREFIX).removesuffix(".weight").rpartition(".")
        if not name.startswith(PEFT_PREFIX) or kind not in ("lora_A", "lora_B"):
            raise AdapterMismatch(f"{folder}: unexpected tensor {name!r}")
        if stem.rpartition(".")[2] not in targets:
            raise AdapterMismatch(f"{folder}: tensor {name!r} is not on a target module")
        pairs.setdefault(f"{stem}.weight", {})[kind] = spec.shape
    for weight, mats in sorted(pairs.items()):
        base = layout.tensors.get(weight)
        if base is None:
            raise AdapterMismatch(f"{folder}: the model has no weight {weight!r}")
        out_dim, in_dim = base.shape
        want = {"lora_A": (rank, in_dim), "lora_B": (out_dim, rank)}
        if mats != want:
            raise AdapterMismatch(f"{folder}: {weight} has LoRA shapes {mats}, the model needs {want}")
    if not pairs:
        raise AdapterMismatch(f"{folder}: {ADAPTER_FILE} holds no LoRA tensors")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return AdapterSpec(rank=rank, scale=float(scale), weights=frozenset(pairs))


def stage(src: Path, dest: Path, sha256: str) -> None:
    """Copy the adapter files of ``src`` into the new folder ``dest`` and check the copy's
    checksum: what is checked is what vLLM reads, then and on any later reload, whatever
    happens to ``src`` (pruned by the learner). Raises AdapterMismatch (``dest`` removed) for a
    missing file or a checksum that is not ``sha256``."""
    src, dest = Path(src), Path(dest)
    dest.mkdir(parents=True)
    try:
        files = [src / ADAPTER_CONFIG, *sorted(src.glob("*.safetensors"))]
        for f in files:
            shutil.copyfile(f, dest / f.name)
        actual = weights_sha256(dest)
    except OSError as exc:
        shutil.rmtree(dest, ignore_errors=True)
        raise AdapterMismatch(f"cannot copy the adapter at {src}: {exc}") from exc
    if actual != sha256:
        shutil.rmtree(dest, ignore_errors=True)
        raise AdapterMismatch(f"checksum mismatch for {src}: expected {sha256}, found {actual}")


def merge(base_dir: Path, adapter_dir: Path, spec: AdapterSpec, out_dir: Path, dtype: str) -> Path:
    """Write ``out_dir/model.safetensors``: every tensor of the base model in ``dtype`` (a torch
    dtype name), with ``W + scale · B · A`` for each weight the adapter changes, computed in
    float32. Returns ``out_dir`` (created). Reads the whole base model (~270 MB in bf16)."""
    import torch
    from safetensors.torch import load_file, save_file

    out_dtype = getattr(torch, dtype)
    base = load_file(Path(base_dir) / WEIGHTS_FILE)
    lora = load_file(Path(adapter_dir) / ADAPTER_FILE)
    merged: dict[str, torch.Tensor] = {}
    for name, w in base.items():
        if name in spec.weights:
            stem = PEFT_PREFIX + name.removesuffix(".weight")
            a = lora[f"{stem}.lora_A.weight"].float()
            b = lora[f"{stem}.lora_B.weight"].float()
            w = w.float() + spec.scale * (b @ a)
        merged[name] = w.to(out_dtype).contiguous()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True)
    save_file(merged, out_dir / WEIGHTS_FILE)
    return out_dir
