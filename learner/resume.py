"""Resuming the committed state: the checkpoint, a version's weights, and what a dead learner
left half-written (docs/design.md §8).

The database is the truth of the learner's state. A version's folder is written before its
commit but means nothing until then: at load, folders above the database's latest version are
deleted (``discard_uncommitted``). ``checkpoint.pt`` (``core.policy_store.CHECKPOINT_FILE``,
tagged with its version) holds the critic, optimizer states and step count; it is written only
after the commit, replaced whole (``write_checkpoint``), and a checkpoint newer than the
database's latest version is ignored (``read_checkpoint``). The policy's weights always come from
a published folder (``load_policy_weights``).
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import torch

from core.policy_store import ADAPTER_FILE, CHECKPOINT_FILE, WEIGHTS_FILE, Layout, layout
from learner.algorithm import Algorithm
from learner.config import LearnerConfig

log = logging.getLogger(__name__)


def discard_uncommitted(policy_dir: Path, committed: int) -> None:
    """Delete the folders under ``policy_dir`` above version ``committed``, the half-written
    ones (``.tmp``, any name ``v…`` that is not a version number) and a half-written checkpoint.

    Such a folder was written by a learner that died (or failed) before the version's commit;
    the next step of that number writes it again.
    """
    policy_dir = Path(policy_dir)
    if not policy_dir.is_dir():
        return
    for d in policy_dir.glob("v[0-9]*"):
        number = d.name[1:]
        if not number.isdigit() or int(number) > committed:
            log.info("deleting %s: not a version the database has committed", d)
            shutil.rmtree(d, ignore_errors=True)
    (policy_dir / (CHECKPOINT_FILE + ".tmp")).unlink(missing_ok=True)


def read_checkpoint(policy_dir: Path, committed: int, kind: str) -> dict | None:
    """The state in ``policy_dir``'s checkpoint (``write_checkpoint``'s keys), None when there is
    none or when its version is newer than ``committed``, the database's latest version (written
    before the version was committed in this database, by older code or into a database
    restored from a backup: it claims updates that never were).

    Raises:
        RuntimeError: the checkpoint is of another kind of policy (``full``, ``lora``) than
            ``kind``: a policy cannot change its kind in one policy directory.
    """
    ckpt = Path(policy_dir) / CHECKPOINT_FILE
    state = torch.load(ckpt, map_location="cpu", weights_only=False) if ckpt.is_file() else None
    if state is not None and state["version"] > committed:
        log.warning("ignoring %s at version %d: the database is at %d", ckpt, state["version"], committed)
        return None
    if state is not None and (state.get("config") or {}).get("policy", {}).get("kind", "full") != kind:
        raise RuntimeError(f"{ckpt} is of another kind of policy than this learner's ({kind})")
    return state


def write_checkpoint(
    policy_dir: Path, version: int, weights_version: int, algorithm: Algorithm, config: LearnerConfig
) -> None:
    """Replace ``policy_dir``'s ``checkpoint.pt`` with ``algorithm``'s state at ``version``
    (``weights_version``: the version whose weights the policy holds; ``config`` the learner's).
    Call only once ``version`` is committed. Written under a ``.tmp`` name and renamed, so a
    reader sees the old checkpoint or the new one."""
    policy_dir = Path(policy_dir)
    tmp = policy_dir / (CHECKPOINT_FILE + ".tmp")
    state = {
        "version": version,
        "weights_version": weights_version,
        "learner": algorithm.state_dict(),
        "config": config.model_dump(mode="json"),
    }
    torch.save(state, tmp)
    tmp.replace(policy_dir / CHECKPOINT_FILE)


def load_policy_weights(algorithm: Algorithm, path: Path, base_dir: Path) -> None:
    """Load the version folder at ``path`` into ``algorithm``'s policy: its full weights, or with
    a LoRA policy its adapter (the base model's folder ``base_dir``, version 0, is the initial
    adapter, B = 0).

    Raises:
        RuntimeError: the folder's layout is not the learner's (full weights, other than the
            base's, for a LoRA learner, or an adapter for a full one; a policy cannot change its
            kind in one policy directory), or its tensors do not match the model.
    """
    from safetensors.torch import load_file

    path = Path(path)
    found = layout(path)
    if algorithm.adapter is not None and found != Layout.ADAPTER:
        if path.resolve() != Path(base_dir).resolve():
            raise RuntimeError(f"{path} holds full weights; this learner trains a LoRA adapter")
        algorithm.reset_policy_to_base()
        return
    if algorithm.adapter is None and found == Layout.ADAPTER:
        raise RuntimeError(f"{path} holds a LoRA adapter; this learner trains the full weights")
    name = ADAPTER_FILE if found == Layout.ADAPTER else WEIGHTS_FILE
    weights = {k: v.float() for k, v in load_file(path / name).items()}
    try:
        missing, unexpected = algorithm.load_policy_weights(weights)
    except ValueError as exc:
        raise RuntimeError(f"the adapter at {path} does not match the policy's: {exc}") from exc
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise RuntimeError(f"policy weights at {path} do not match the model: {missing} {unexpected}")
