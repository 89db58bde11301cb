"""Policy weights on disk: the checksum a policy event carries, and the tensor layout check.

A policy version is a directory of ``*.safetensors`` files. Before the server swaps one in,
it checks that the files hold exactly the serving model's tensors with the right shapes and
dtypes: vLLM's in-place reload only warns about a missing tensor (the old values stay, so one
version number would serve a mix of two versions) and asserts inside the worker on a wrong
shape (docs/design.md §7, §8). Only the safetensors headers are read (a few kB), never the tensors.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path

from core.policy_store import is_file

# A safetensors header is a little-endian u64 length, then that many bytes of JSON. Real
# headers of this model are ~25 kB; the bound keeps a corrupt length from allocating gigabytes.
MAX_HEADER_BYTES = 100 << 20
# torch dtype names (the SAOSERVE_DTYPE setting) → safetensors dtype names.
SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "half": "F16", "float": "F32"}


class WeightsMismatch(ValueError):
    """A weights directory does not hold the serving model's tensors (names, shapes, dtypes),
    or a safetensors file is malformed (header unreadable, data not where it says)."""


@dataclass(frozen=True)
class TensorSpec:
    """One tensor's layout: ``dtype`` is the safetensors name (``BF16``, ``F32``, ...)."""

    dtype: str
    shape: tuple[int, ...]


def weights_sha256(model_dir: Path) -> str:
    """sha256 over the model's safetensors files (a manifest hash when there are several).

    One file: the file's own sha256. Several: sha256 of the lines ``<sha256>  <name>\\n`` sorted
    by name. This is the checksum a policy event carries. Raises FileNotFoundError when the
    directory has no safetensors file.
    """
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    digests = [(f.name, file_sha256(f)) for f in files]
    if len(digests) == 1:
        return digests[0][1]
    manifest = "".join(f"{d}  {n}\n" for n, d in digests)
    return hashlib.sha256(manifest.encode()).hexdigest()


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_header(path: Path) -> dict[str, TensorSpec]:
    """The tensors a safetensors file declares, ``name → TensorSpec``, from its header only.

    Raises WeightsMismatch if the header is not a safetensors header or if the tensors' data
    offsets do not tile the file's data section exactly (a truncated or padded file).
    """
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw_len = f.read(8)
        if len(raw_len) < 8:
            raise WeightsMismatch(f"{path.name}: shorter than a safetensors header")
        (n,) = struct.unpack("<Q", raw_len)
        if n > min(MAX_HEADER_BYTES, size - 8):
            raise WeightsMismatch(f"{path.name}: header length {n} does not fit the file ({size} bytes)")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise WeightsMismatch(f"{path.name}: header is not JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise WeightsMismatch(f"{path.name}: header is not a JSON object")
    header.pop("__metadata__", None)
    specs: dict[str, TensorSpec] = {}
    spans: list[tuple[int, int]] = []
    for name, info in header.items():
        try:
            dtype, shape, (start, end) = info["dtype"], info["shape"], info["data_offsets"]
            specs[name] = TensorSpec(str(dtype), tuple(int(d) for d in shape))
            spans.append((int(start), int(end)))
        except (KeyError, TypeError, ValueError) as exc:
            raise WeightsMismatch(f"{path.name}: malformed entry for tensor {name!r}") from exc
    pos = 0
    for start, end in sorted(spans):
        if start != pos or end < start:
            raise WeightsMismatch(f"{path.name}: tensor data offsets do not tile the data section")
        pos = end
    if pos != size - 8 - n:
        raise WeightsMismatch(f"{path.name}: tensors cover {pos} data bytes, the file has {size - 8 - n}")
    return specs


def read_specs(model_dir: Path) -> dict[str, TensorSpec]:
    """Every tensor declared by the ``*.safetensors`` files of ``model_dir``.

    Raises FileNotFoundError without safetensors files, WeightsMismatch for a malformed header
    or a tensor declared by two files.
    """
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    specs: dict[str, TensorSpec] = {}
    for f in files:
        for name, spec in read_header(f).items():
            if name in specs:
                raise WeightsMismatch(f"tensor {name!r} is in more than one file of {model_dir}")
            specs[name] = spec
    return specs


@dataclass(frozen=True)
class WeightsLayout:
    """The tensors a policy version must hold to be served in place of the running one.

    ``tensors`` are required (name → shape, dtype); ``optional`` may be present with that
    layout (a tied LM head, which the learner omits and ``save_pretrained`` may write).
    ``dtypes`` are the accepted dtype names besides each tensor's own (the serving dtype:
    version 0 is bf16 on disk while the learner publishes in the serving dtype).
    """

    tensors: dict[str, TensorSpec]
    optional: dict[str, TensorSpec]
    dtypes: frozenset[str]

    @classmethod
    def of_model(cls, model_dir: Path, serving_dtype: str) -> WeightsLayout:
        """The layout of the model in ``model_dir`` (policy version 0) served in ``serving_dtype``
        (a torch dtype name: ``float32``, ``bfloat16``, ``float16``)."""
        tensors = read_specs(model_dir)
        optional: dict[str, TensorSpec] = {}
        embed = tensors.get("model.embed_tokens.weight")
        if embed is not None and "lm_head.weight" not in tensors and _tied(model_dir):
            optional["lm_head.weight"] = embed
        accepted = {SAFETENSORS_DTYPES.get(serving_dtype, serving_dtype)}
        return cls(tensors=tensors, optional=optional, dtypes=frozenset(accepted))

    def check(self, weights_dir: Path) -> None:
        """Raise WeightsMismatch naming every tensor of ``weights_dir`` that is missing,
        unexpected, or has another shape or dtype; FileNotFoundError without safetensors."""
        found = read_specs(weights_dir)
        problems = [f"missing tensor {n!r}" for n in sorted(self.tensors.keys() - found.keys())]
        for name in sorted(found):
            want = self.tensors.get(name) or self.optional.get(name)
            got = found[name]
            if want is None:
                problems.append(f"unexpected tensor {name!r}")
            elif got.shape != want.shape:
                problems.append(f"tensor {name!r} has shape {list(got.shape)}, the model {list(want.shape)}")
            elif got.dtype != want.dtype and got.dtype not in self.dtypes:
                accepted = sorted({want.dtype, *self.dtypes})
                problems.append(f"tensor {name!r} has dtype {got.dtype}, expected one of {accepted}")
        if problems:
            shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
            raise WeightsMismatch(f"weights at {weights_dir} do not match the serving model: {shown}")


def _tied(model_dir: Path) -> bool:
    """Whether the model's config ties the LM head to the input embeddings (default: yes, as
    transformers' ``PretrainedConfig``)."""
    config = Path(model_dir) / "config.json"
    if not is_file(config):
        return False
    return bool(json.loads(config.read_text()).get("tie_word_embeddings", True))
