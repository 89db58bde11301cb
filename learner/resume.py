"""Resuming the committed state: the checkpoint, a version's weights, and what a dead learner
left half-written (docs/design.md §8).

The database is the truth of the learner's state. A version's folder is written before its
commit but means nothing until then: at load, folders above the database's latest version are
deleted (``discard_uncommitted``). ``checkpoint.pt`` (``core.policy_store.CHECKPOINT_FILE``,
tagged with its version) holds the critic, optimizer states and step count; it is written only
after the commit, replaced whole (``write_checkpoint``), and a checkpoint newer than the
database's latest version is ignored (``read_checkpoint``). A promoted version's whole learner
state is kept beside it (``write_state``, ``states/``), so a rollback restores the critic,
the optimizers, the step count and the baselines with the weights; a start resumes from the
newest of the checkpoint and those states (``newest_state``). The policy's weights always come
from a published folder (``load_policy_weights``).
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import torch

from core.policy_store import ADAPTER_CONFIG, ADAPTER_FILE, CHECKPOINT_FILE, WEIGHTS_FILE, Layout, layout
from learner.algo.algorithm import Algorithm
from learner.config import LearnerConfig, LoraPolicy, PolicyConfig

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
    for v in state_versions(policy_dir):
        if v > committed:
            log.info("deleting the learner state of version %d: not committed", v)
            state_path(policy_dir, v).unlink(missing_ok=True)
    for tmp in (policy_dir / STATES_DIR).glob("*.tmp"):
        tmp.unlink(missing_ok=True)


def read_checkpoint(policy_dir: Path, committed: int, policy: PolicyConfig) -> dict | None:
    """The state in ``policy_dir``'s checkpoint (``write_checkpoint``'s keys), None when there is
    none or when its version is newer than ``committed``, the database's latest version (written
    before the version was committed in this database, by older code or into a database
    restored from a backup: it claims updates that never were).

    Raises:
        RuntimeError: the checkpoint is of another kind of policy (``full``, ``lora``) than
            ``policy``, or of other LoRA settings (``check_policy``): a policy cannot change its
            kind or its adapter's settings in one policy directory.
    """
    ckpt = Path(policy_dir) / CHECKPOINT_FILE
    state = torch.load(ckpt, map_location="cpu", weights_only=False) if ckpt.is_file() else None
    if state is not None and state["version"] > committed:
        log.warning("ignoring %s at version %d: the database is at %d", ckpt, state["version"], committed)
        return None
    return _of_kind(state, ckpt, policy)


def _of_kind(state: dict | None, path: Path, policy: PolicyConfig) -> dict | None:
    """``state`` (or None) if a learner of ``policy`` may resume it (``check_policy`` on its
    config's policy section). Raises RuntimeError otherwise."""
    if state is not None:
        check_policy((state.get("config") or {}).get("policy") or {}, policy, path)
    return state


def check_policy(saved: dict, policy: PolicyConfig, path: Path) -> None:
    """Whether ``saved`` (the ``policy`` section of the config a state at ``path`` was saved
    under) may be resumed by a learner of ``policy``: the same kind and, for LoRA, the same
    adapter settings (``LoraPolicy.changes_from``).

    Raises:
        RuntimeError: another kind of policy, or LoRA settings changed (named, old → new).
    """
    if saved.get("kind", "full") != policy.kind:
        raise RuntimeError(f"{path} is of another kind of policy than this learner's ({policy.kind})")
    if isinstance(policy, LoraPolicy):
        change = policy.changes_from(LoraPolicy.model_validate(saved))
        if change is not None:
            raise RuntimeError(
                f"{path} was saved under other LoRA settings ({change}); a policy directory keeps "
                "its adapter's settings: start the changed policy in a new one"
            )


def write_checkpoint(
    policy_dir: Path, version: int, weights_version: int, algorithm: Algorithm, config: LearnerConfig
) -> None:
    """Replace ``policy_dir``'s ``checkpoint.pt`` with ``algorithm``'s state at ``version``
    (``weights_version``: the version whose weights the policy holds; ``config`` the learner's).
    Call only once ``version`` is committed. Written under a ``.tmp`` name and renamed, so a
    reader sees the old checkpoint or the new one."""
    _save(Path(policy_dir) / CHECKPOINT_FILE, version, weights_version, algorithm, config)


def _save(
    path: Path, version: int, weights_version: int, algorithm: Algorithm, config: LearnerConfig
) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    state = {
        "version": version,
        "weights_version": weights_version,
        "learner": algorithm.state_dict(),
        "config": config.model_dump(mode="json"),
    }
    torch.save(state, tmp)
    tmp.replace(path)


STATES_DIR = "states"
"""The folder under the policy directory that holds a promoted version's learner state,
``v<version>.pt`` (``write_state``): what a rollback to that version restores."""


def state_path(policy_dir: Path, version: int) -> Path:
    """Where the learner state of ``version`` is kept (it may not exist)."""
    return Path(policy_dir) / STATES_DIR / f"v{version:06d}.pt"


def write_state(policy_dir: Path, version: int, algorithm: Algorithm, config: LearnerConfig) -> None:
    """Keep ``algorithm``'s whole state (policy, critic, both optimizers, step count, running-mean
    baselines) as the state of ``version``, whose weights its policy holds: a checkpoint per
    promoted version (issue 40, item 5), written when the version is promoted and, for a
    rollback's version, before its commit. Same format and same atomic replace as
    ``write_checkpoint``."""
    _save(state_path(policy_dir, version), version, version, algorithm, config)


def read_state(policy_dir: Path, version: int) -> dict | None:
    """The state ``write_state`` kept for ``version``, None when there is none."""
    path = state_path(policy_dir, version)
    return torch.load(path, map_location="cpu", weights_only=False) if path.is_file() else None


def state_versions(policy_dir: Path) -> list[int]:
    """The versions with a kept state, oldest first (names that are no ``v<number>.pt`` are
    not states)."""
    found = []
    for f in (Path(policy_dir) / STATES_DIR).glob("v*.pt"):
        number = f.name[1:-3]
        if number.isdigit():
            found.append(int(number))
    return sorted(found)


def prune_states(policy_dir: Path, keep: set[int]) -> None:
    """Delete the kept states of the versions not in ``keep``."""
    for v in state_versions(policy_dir):
        if v not in keep:
            state_path(policy_dir, v).unlink(missing_ok=True)


def newest_state(
    policy_dir: Path, committed: int, policy: PolicyConfig, rejected, checkpoint: dict | None
) -> dict | None:
    """The learner state a start resumes from: the newest of ``checkpoint`` (the checkpoint's
    state at most at ``committed``: ``read_checkpoint``, or a sharded learner's, read by the
    caller) and the kept states (``write_state``) at or below ``committed``, leaving out any
    whose weights version ``rejected(version)`` says was rejected since.

    So a crash right after a rollback's commit resumes from the state the rollback restored
    (the rollback's version is newer than the last checkpoint), not from the checkpoint of the
    lineage it rejected; a checkpoint newer than the rollback (steps trained since) wins. Ties
    go to the checkpoint. Raises RuntimeError as ``read_checkpoint`` for a kept state of another
    policy kind or other LoRA settings.
    """
    if checkpoint is not None and rejected(checkpoint.get("weights_version", checkpoint["version"])):
        log.info(
            "the checkpoint at version %d holds a rejected version's weights: not resumed",
            checkpoint["version"],
        )
        checkpoint = None
    for v in reversed(state_versions(policy_dir)):
        if v > committed or rejected(v):
            continue
        if checkpoint is not None and checkpoint["version"] >= v:
            return checkpoint
        return _of_kind(read_state(policy_dir, v), state_path(policy_dir, v), policy)
    return checkpoint


def load_policy_weights(algorithm: Algorithm, path: Path, base_dir: Path) -> None:
    """Load the version folder at ``path`` into ``algorithm``'s policy: its full weights, or with
    a LoRA policy its adapter (the base model's folder ``base_dir``, version 0, is the initial
    adapter, B = 0).

    Raises:
        RuntimeError: the folder's layout is not the learner's (full weights, other than the
            base's, for a LoRA learner, or an adapter for a full one; a policy cannot change its
            kind in one policy directory), an adapter of other settings (``check_adapter_settings``),
            or its tensors do not match the model.
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
    if algorithm.adapter is not None:
        check_adapter_settings(path, algorithm.adapter.config)
    name = ADAPTER_FILE if found == Layout.ADAPTER else WEIGHTS_FILE
    weights = {k: v.float() for k, v in load_file(path / name).items()}
    try:
        missing, unexpected = algorithm.load_policy_weights(weights)
    except ValueError as exc:
        raise RuntimeError(f"the adapter at {path} does not match the policy's: {exc}") from exc
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise RuntimeError(f"policy weights at {path} do not match the model: {missing} {unexpected}")


def check_adapter_settings(path: Path, config: LoraPolicy) -> None:
    """Whether the adapter folder at ``path`` was made under ``config``'s rank, α and scaling rule
    (its ``adapter_config.json``: ``r``, ``lora_alpha``, ``use_rslora``): the same A and B under
    another α or rule compute another update (``LoraPolicy.changes_from``).

    Raises:
        RuntimeError: the file cannot be read, or the settings differ (named, old → new).
    """
    try:
        saved = json.loads((Path(path) / ADAPTER_CONFIG).read_text(encoding="utf-8"))
        made = config.model_copy(
            update={"rank": saved["r"], "alpha": saved["lora_alpha"], "rslora": bool(saved.get("use_rslora"))}
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise RuntimeError(f"cannot read the adapter's settings at {path}: {exc}") from exc
    change = config.changes_from(made)
    if change is not None:
        raise RuntimeError(
            f"the adapter at {path} was made under other LoRA settings ({change}); a policy "
            "directory keeps its adapter's settings: start the changed policy in a new one"
        )
