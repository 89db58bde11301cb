"""The learner over N ranks (``saoserve learn`` under ``torchrun``): rank 0 leads, the others follow.

Issue 38, docs/scaling.md ("The learner on GPUs and across processes"), docs/design.md §8. Launched by
``torchrun --nproc-per-node N -m saoserve.cli learn …`` (or ``saoserve learn --ranks N``, which
runs exactly that), every rank builds the same ``LearnerConfig``; ``init`` joins the process
group (gloo on the CPU, NCCL on GPUs, chosen from the device) and places the models
(``learner.models.placement``: FSDP2, each rank a contiguous share of every batch's rows).

- **Rank 0** runs the whole learner (``RankedLearner``, a ``learner.process.Learner``): it alone
  reads the log, joins, commits offsets, runs the guard, writes and commits versions. Its
  algorithm is a ``MirroredAlgorithm``: every call that touches the models (build, step, load
  or gather weights, checkpoint, version, the guard's no-grad measure of the policy's KL to the
  base) is first broadcast to the other ranks on a gloo
  control group (the batch as rank 0 collated it), then run on rank 0 too; each call ends with
  every rank's report (``Channel.report``), so an error on any rank raises on rank 0.
- **Ranks 1…N−1** (``follow``) wait for those calls and run them on their own models. They
  touch no database, log or policy folder (the sharded checkpoint aside, each writing its
  shards).

A version is committed by rank 0 only after the step's call returned on every rank (its
report), and its weights are gathered from every rank's shards after their optimiser steps.
A rank that fails or is killed ends the group (``torchrun`` stops the others; a broken control
channel raises on every rank): nothing of the step is committed, the database stays the truth,
and the next start reloads the committed state as a single learner does. A rank that fails in
the middle of a collective (out of memory in a backward pass) leaves the others waiting in it
until ``STEP_TIMEOUT``; then the group fails the same way.

Checkpoints are ``torch.distributed.checkpoint`` folders (``save_checkpoint``): each rank writes
its shards of the trained parameters (``ignore_frozen_params``: a LoRA policy's adapter, the
critic's MLP and head) and of the optimiser states, keyed by parameter name, so a checkpoint
written by N ranks loads on M (DCP reshards). Rank 0 then writes the small state (version, step
count, running-mean history) and swaps ``checkpoint.dcp.json`` to point at the folder.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from core.dead_letters import describe
from core.settings import Settings
from learner import faults
from learner.algo.algorithm import Algorithm
from learner.algo.registry import build_algorithm
from learner.config import ConfigError, LearnerConfig
from learner.data.batch import Batch
from learner.models.device import resolve
from learner.models.placement import Placement
from learner.process import Learner, run_learner

log = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoint.dcp"
"""The folder (under the policy folder) of the sharded checkpoints, one subfolder per version."""
CHECKPOINT_POINTER = "checkpoint.dcp.json"
"""The file naming the current sharded checkpoint: ``{"version": v, "folder": name}``."""
META_FILE = "learner.pt"
"""In a checkpoint folder, rank 0's small state (version, step, running-mean history, config)."""
STEP_TIMEOUT = timedelta(minutes=10)
"""How long a collective of the models waits for a rank before the group fails."""
CONTROL_TIMEOUT = timedelta(days=30)
"""How long a follower waits for rank 0's next call (it idles while no batch is full)."""


def launched() -> bool:
    """Whether this process was started by ``torchrun`` (``WORLD_SIZE`` and ``RANK`` set)."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def check_config(config: LearnerConfig, world: int) -> None:
    """Refuse what the sharded learner does not do.

    Raises:
        ConfigError: the gate with more than one rank (it generates answers with the whole policy
            on rank 0, which holds a shard of it), or a batch smaller than the ranks.
    """
    if world > 1 and config.guard.gate is not None:
        raise ConfigError(
            "the guard's gate generates with the whole policy on one process and does not run "
            f"with {world} ranks: set guard.gate to null, or run one rank"
        )
    if config.batch_size < world:
        raise ConfigError(f"batch_size ({config.batch_size}) must be at least the number of ranks ({world})")


@dataclass
class Channel:
    """Rank 0's calls to the other ranks, on a gloo group of its own (``CONTROL_TIMEOUT``)."""

    group: Any
    rank: int
    world: int

    def send(self, op: str, *args) -> None:
        """Rank 0: broadcast the call ``op(*args)`` (pickled: a batch is a few MB at most)."""
        dist.broadcast_object_list([(op, args)], src=0, group=self.group)

    def receive(self) -> tuple[str, tuple]:
        """Ranks > 0: the next call (blocks; raises when rank 0 is gone)."""
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def tensors(
        self, weights: dict[str, torch.Tensor] | None, spec: list | None = None
    ) -> dict[str, torch.Tensor]:
        """Broadcast ``weights`` (rank 0, CPU tensors) tensor by tensor; the others pass ``spec``
        (name, shape, dtype per tensor, as rank 0 sent it) and get the tensors."""
        if weights is not None:
            for t in weights.values():
                dist.broadcast(t.contiguous(), src=0, group=self.group)
            return weights
        out = {}
        for name, shape, dtype in spec:
            t = torch.empty(shape, dtype=dtype)
            dist.broadcast(t, src=0, group=self.group)
            out[name] = t
        return out

    def report(self, error: str | None) -> None:
        """Every rank, after each call: gather the ranks' errors on rank 0, where the first one
        is raised as RuntimeError naming its rank (the others return)."""
        errors: list[Any] = [None] * self.world if self.rank == 0 else None
        dist.gather_object(error, errors, dst=0, group=self.group)
        if self.rank == 0:
            failed = [(r, e) for r, e in enumerate(errors) if e is not None]
            if failed:
                rank, message = failed[0]
                raise RuntimeError(f"learner rank {rank} failed: {message}")


@dataclass(frozen=True)
class CheckpointRef:
    """A sharded checkpoint's folder, as ``RankedLearner._read_checkpoint`` hands it to
    ``load_state_dict`` (every rank loads its shards from it)."""

    folder: Path


def _trained_state(algorithm: Algorithm) -> dict:
    """The DCP state of ``algorithm``: each trained model's parameters and its optimiser's
    state, keyed by parameter name (``get_state_dict``, frozen parameters left out)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(ignore_frozen_params=True)
    # The policy itself, not its FSDP root (learner.models.placement): the keys are then the model's
    # own with any number of ranks, one included.
    pairs = [("policy", algorithm.policy, algorithm.policy_opt)]
    if algorithm.critic is not None:
        pairs.append(("critic", algorithm.critic, algorithm.critic_opt))
    state = {}
    for name, model, opt in pairs:
        state[name], state[f"{name}_optimizer"] = get_state_dict(model, [opt], options=options)
    return state


def save_checkpoint(algorithm: Algorithm, folder: Path) -> None:
    """Every rank: write this rank's shards of ``algorithm``'s trained state into ``folder``
    (``torch.distributed.checkpoint``); rank 0 also writes ``META_FILE``."""
    import torch.distributed.checkpoint as dcp

    dcp.save(_trained_state(algorithm), checkpoint_id=str(folder))
    if algorithm.placement.rank == 0:
        baseline = getattr(algorithm, "baseline", None)
        meta = {
            "step": algorithm.steps,
            "baseline": baseline.state_dict() if baseline is not None else None,
            "config": algorithm.config.model_dump(mode="json"),
        }
        torch.save(meta, Path(folder) / META_FILE)


def load_checkpoint(algorithm: Algorithm, folder: Path) -> None:
    """Every rank: load its shards of the trained state from ``folder`` (written by any number
    of ranks: DCP reshards) and rank 0's ``META_FILE`` (step count, running-mean history).

    The policy optimizer keeps this config's learning rates (``Algorithm.set_policy_rates``).

    Raises:
        RuntimeError: the checkpoint is of another kind of policy, of other LoRA settings
            (``learner.resume.check_policy``) or of another algorithm (its keys differ).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    from learner.resume import check_policy

    meta = torch.load(Path(folder) / META_FILE, weights_only=False)
    check_policy(meta["config"]["policy"], algorithm.config.policy, Path(folder))
    rates = algorithm.policy_rates()
    state = _trained_state(algorithm)
    # Every trained tensor is looked up in the checkpoint (dcp.load fails on a missing one); the
    # frozen ones, left out of it, keep the base model's values (strict=False).
    dcp.load(state, checkpoint_id=str(folder))
    options = StateDictOptions(ignore_frozen_params=True, strict=False)
    set_state_dict(
        algorithm.policy,
        [algorithm.policy_opt],
        model_state_dict=state["policy"],
        optim_state_dict=state["policy_optimizer"],
        options=options,
    )
    algorithm.set_policy_rates(rates)
    if algorithm.critic is not None:
        set_state_dict(
            algorithm.critic,
            [algorithm.critic_opt],
            model_state_dict=state["critic"],
            optim_state_dict=state["critic_optimizer"],
            options=options,
        )
    baseline = getattr(algorithm, "baseline", None)
    if baseline is not None and meta["baseline"] is not None:
        baseline.load_state_dict(meta["baseline"])
    algorithm.steps = int(meta["step"])


def _apply(algorithm: Algorithm, op: str, args: tuple, leader: bool):
    """Run the call ``op(*args)`` on this rank's ``algorithm``; the result (rank 0's is used)."""
    if op == "load_checkpoint":
        return load_checkpoint(algorithm, *args)
    if op == "save_checkpoint":
        return save_checkpoint(algorithm, *args)
    if op == "save_adapter" and not leader:
        # Rank 0 writes the folder; the others take part in gathering the tensors.
        return algorithm.adapter.tensors(args[1])
    return getattr(algorithm, op)(*args)


class MirroredAlgorithm:
    """Rank 0's algorithm: each call that touches the models is broadcast to the other ranks,
    run here too, and checked on every rank (``Channel.report``); attributes (``steps``,
    ``policy``, ``adapter``, ``config``, ``critic``) are this rank's own.

    Every method raises what the algorithm raises on rank 0, or RuntimeError naming the rank
    where it failed elsewhere.
    """

    def __init__(self, inner: Algorithm, channel: Channel) -> None:
        self.inner = inner
        self.channel = channel

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def _call(self, op: str, *args):
        self.channel.send(op, *args)
        return self._finish(op, args)

    def _finish(self, op: str, args: tuple):
        try:
            result = _apply(self.inner, op, args, leader=True)
        except Exception as exc:
            try:
                self.channel.report(describe(exc))
            except RuntimeError:
                pass  # the report names this rank's own error: raise the error itself
            raise
        self.channel.report(None)
        return result

    def step(self, batch: Batch) -> dict:
        """``Algorithm.step`` on every rank (each its share of ``batch``'s rows)."""
        return self._call("step", batch)

    def reference_kl(self, batch: Batch) -> float:
        """``Algorithm.reference_kl`` on every rank (each evaluates its share of ``batch``'s rows,
        gathered on all: every rank computes the same figure; rank 0's is returned)."""
        return self._call("reference_kl", batch)

    def warm_start(self, policy_dir: Path) -> Path | None:
        """``Algorithm.warm_start`` on every rank (each reads the file)."""
        return self._call("warm_start", policy_dir)

    def on_version(self, version: int) -> None:
        """``Algorithm.on_version`` on every rank."""
        return self._call("on_version", version)

    def reset_policy_optimizer(self) -> None:
        """``Algorithm.reset_policy_optimizer`` on every rank."""
        return self._call("reset_policy_optimizer")

    def reset_policy_to_base(self) -> None:
        """``Algorithm.reset_policy_to_base`` on every rank."""
        return self._call("reset_policy_to_base")

    def policy_weights(self, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
        """``Algorithm.policy_weights``, gathered from every rank's shards."""
        return self._call("policy_weights", dtype)

    def save_adapter(self, folder: Path, dtype: torch.dtype) -> Path:
        """``Algorithm.save_adapter`` here, the adapter's tensors gathered from every rank."""
        return self._call("save_adapter", folder, dtype)

    def load_policy_weights(self, weights: dict[str, torch.Tensor]) -> tuple[list[str], list[str]]:
        """``Algorithm.load_policy_weights`` on every rank, ``weights`` broadcast from here."""
        cpu = {k: v.to("cpu") for k, v in weights.items()}
        self.channel.send("load_policy_weights", [(k, v.shape, v.dtype) for k, v in cpu.items()])
        self.channel.tensors(cpu)
        return self._finish("load_policy_weights", (cpu,))

    def load_state_dict(self, state: CheckpointRef) -> None:
        """Load the sharded checkpoint ``state`` names on every rank (``load_checkpoint``)."""
        return self._call("load_checkpoint", state.folder)

    def save_checkpoint(self, folder: Path) -> None:
        """Write the sharded checkpoint into ``folder`` from every rank (``save_checkpoint``)."""
        return self._call("save_checkpoint", folder)


class RankedLearner(Learner):
    """Rank 0's learner (module docstring): a ``learner.process.Learner`` whose algorithm is
    mirrored on every rank and whose checkpoint is sharded."""

    def __init__(self, settings: Settings, config: LearnerConfig, placement: Placement, channel: Channel):
        super().__init__(settings, config)
        self.placement = placement
        self.channel = channel

    def _build_algorithm(self, load_policy) -> Algorithm:
        self.channel.send("build")
        try:
            algorithm = build_algorithm(self.config, load_policy, self.placement)
        except Exception as exc:
            try:
                self.channel.report(describe(exc))
            except RuntimeError:
                pass  # as in MirroredAlgorithm._finish: the error itself is raised
            raise
        self.channel.report(None)
        return MirroredAlgorithm(algorithm, self.channel)

    def _read_checkpoint(self, committed: int) -> dict | None:
        """The sharded checkpoint's state (``CheckpointRef`` as ``learner``), None when there is
        none or it is newer than ``committed`` (written before a commit the database lacks)."""
        pointer = self.policy_dir / CHECKPOINT_POINTER
        if not pointer.is_file():
            return None
        found = json.loads(pointer.read_text(encoding="utf-8"))
        if found["version"] > committed:
            log.warning(
                "ignoring %s at version %d: the database is at %d", pointer, found["version"], committed
            )
            return None
        folder = self.policy_dir / CHECKPOINT_DIR / found["folder"]
        return {
            "version": found["version"],
            "weights_version": found["weights_version"],
            "learner": CheckpointRef(folder),
        }

    def _write_state(self, version: int, algorithm: Algorithm) -> bool:
        """Kept states (a promoted version's whole learner, ``learner.resume.write_state``) are
        not written across ranks: a rollback restores the version's weights with fresh optimizer
        moments, and a restart resumes from the sharded checkpoint (docs/scaling.md, "Limits")."""
        return False

    def _read_state(self, version: int) -> dict | None:
        return None

    def _checkpoint(self, version: int) -> None:
        """Write the sharded checkpoint of ``version`` (every rank), then point at it and delete
        the older ones; call only once ``version`` is committed."""
        root = self.policy_dir / CHECKPOINT_DIR
        name = f"v{version:06d}"
        shutil.rmtree(root / name, ignore_errors=True)
        root.mkdir(parents=True, exist_ok=True)
        self.algorithm.save_checkpoint(root / name)
        pointer = self.policy_dir / CHECKPOINT_POINTER
        tmp = pointer.with_name(pointer.name + ".tmp")
        tmp.write_text(
            json.dumps({"version": version, "weights_version": self.weights_version, "folder": name}),
            encoding="utf-8",
        )
        tmp.replace(pointer)
        for old in root.iterdir():
            if old.name != name:
                shutil.rmtree(old, ignore_errors=True)
        self._durable_version = version


def follow(config: LearnerConfig, settings: Settings, placement: Placement, channel: Channel) -> None:
    """Ranks > 0: run rank 0's calls on this rank's models until it says ``stop`` (or is gone,
    when the control channel raises). SIGINT and SIGTERM are left to rank 0, whose clean stop
    still needs this rank (the final checkpoint)."""
    from transformers import AutoModelForCausalLM

    def load_policy():
        return AutoModelForCausalLM.from_pretrained(settings.resolved_model_dir, dtype=torch.float32)

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    algorithm = None
    while True:
        op, args = channel.receive()
        if op == "stop":
            return
        error = None
        try:
            if op == "build":
                algorithm = None
                algorithm = build_algorithm(config, load_policy, placement)
            elif op == "load_policy_weights":
                algorithm.load_policy_weights(channel.tensors(None, args[0]))
            else:
                _apply(algorithm, op, args, leader=False)
            if op == "step":
                faults.fault_point("during_step")
        except Exception as exc:
            log.exception("rank %d: %s failed", placement.rank, op)
            error = describe(exc)
        channel.report(error)


def init(config: LearnerConfig) -> tuple[Placement, Channel]:
    """Join the process group ``torchrun`` describes (gloo on the CPU, NCCL on GPUs, from the
    device this rank resolves to), with a gloo control group beside it.

    Raises:
        learner.models.device.DeviceError: the device is not here (``cuda`` without a GPU, or fewer
            GPUs than local ranks).
        ConfigError: as ``check_config``.
    """
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    check_config(config, world)
    device = resolve(config.device, int(os.environ.get("LOCAL_RANK", "0")))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend=backend, timeout=STEP_TIMEOUT)
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    placement = Placement(device, rank, world, bf16=config.bf16)
    return placement, Channel(control, rank, world)


def run_ranked(settings: Settings, config: LearnerConfig) -> Learner | None:
    """This rank's part of ``saoserve learn`` under ``torchrun``: rank 0 runs the learner
    (``learner.process.run_learner`` with a ``RankedLearner``) and tells the others to stop when
    it ends; the others ``follow``. Returns rank 0's learner, None elsewhere. Raises as ``init``."""
    placement, channel = init(config)
    try:
        if placement.rank != 0:
            if settings.learner_threads is not None:
                torch.set_num_threads(settings.learner_threads)
            follow(config, settings, placement, channel)
            _leave_together(channel)
            return None
        try:
            return run_learner(
                settings, config, make_learner=lambda s, c: RankedLearner(s, c, placement, channel)
            )
        finally:
            try:
                channel.send("stop")
            except Exception:
                log.warning("could not tell the other ranks to stop (one is gone)")
            else:
                _leave_together(channel)
    finally:
        dist.destroy_process_group()


def _leave_together(channel: Channel) -> None:
    """Once rank 0 told every rank to stop (its learner ended or raised; each other rank has
    returned from ``follow``): wait on the control group until every rank is done with its
    collectives, so no rank tears the groups down while another still uses them
    (``destroy_process_group`` is collective), and no follower waits in this barrier for a rank
    0 that left. A failure is logged; the groups are destroyed either way."""
    try:
        dist.barrier(group=channel.group)
    except Exception:
        log.warning("rank %d: not every rank reached the end (one is gone)", channel.rank)
