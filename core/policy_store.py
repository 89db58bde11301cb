"""The policy store on disk: one folder per published version, the contract between the learner
that writes it and the servers and admin routes that read it (docs/design.md §7).

A version's folder is ``<policy_dir>/v<version, six digits>`` and holds one of two layouts:

- **full weights**: ``model.safetensors`` (every tensor of the serving model) plus the base
  model's config and tokenizer files;
- **a LoRA adapter**: ``adapter_model.safetensors`` and ``adapter_config.json`` in PEFT's layout
  (the files ``PeftModel.save_pretrained`` writes and vLLM's ``LoRARequest`` loads), applied to
  the base model.

Its checksum is ``core.weights.weights_sha256`` of the folder (the safetensors files it holds).
The learner writes a folder under a ``.tmp`` name and renames it, so a reader never sees half a
version. The learner's checkpoint lives beside the folders, ``CHECKPOINT_FILE``.
"""

from __future__ import annotations

import enum
from pathlib import Path

WEIGHTS_FILE = "model.safetensors"
ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
CHECKPOINT_FILE = "checkpoint.pt"


class Layout(enum.StrEnum):
    """What a version's folder holds."""

    FULL = "full"
    ADAPTER = "adapter"


def version_dir(policy_dir: Path, version: int) -> Path:
    """The folder of ``version`` (an int ≥ 0) under ``policy_dir``; it may not exist.

    Raises:
        ValueError: ``version`` is negative.
    """
    if version < 0:
        raise ValueError(f"a policy version is >= 0, not {version}")
    return Path(policy_dir) / f"v{version:06d}"


def folder_version(path: Path) -> int | None:
    """The version a folder name ``v<digits>`` stands for, None for any other name (a ``.tmp``
    folder being written, the checkpoint)."""
    name = Path(path).name
    return int(name[1:]) if name.startswith("v") and name[1:].isdigit() else None


def version_dirs(policy_dir: Path) -> list[tuple[int, Path]]:
    """Every version folder under ``policy_dir`` as ``(version, path)``, oldest first."""
    found = [(folder_version(d), d) for d in Path(policy_dir).glob("v[0-9]*") if d.is_dir()]
    return sorted((v, d) for v, d in found if v is not None)


def is_file(path: Path) -> bool:
    """Whether ``path`` is a regular file; False also where the operating system refuses to look
    (a name too long, a component not searchable: ``Path.is_file`` raises those ``OSError``s),
    as a path an operator typed may be any string."""
    try:
        return Path(path).is_file()
    except OSError:
        return False


def layout(path: Path) -> Layout | None:
    """The layout of the version folder at ``path``: ``ADAPTER`` when it holds both adapter files,
    ``FULL`` when it holds the weights file, None when it holds neither (deleted, pruned, a
    folder that is not a version, or a path the system cannot look at: ``is_file``)."""
    path = Path(path)
    if is_file(path / ADAPTER_FILE) and is_file(path / ADAPTER_CONFIG):
        return Layout.ADAPTER
    if is_file(path / WEIGHTS_FILE):
        return Layout.FULL
    return None
