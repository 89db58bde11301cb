"""Mixed precision for the learner: bf16 compute weights, float32 master weights and optimizer.

Why (docs/design.md §7, docs/precision.md): the CPUs here have AMX-BF16 tiles, on which a bf16
matmul runs several times faster than float32. ``torch.autocast`` on a float32 model reaches them
only partly: every matmul first casts its float32 weight and input to bf16 (a copy per call, and
another for the gradient), and the residual stream, norms and other elementwise work stay float32.
Here the model itself is bf16 (weights, activations, gradients) and every trainable parameter has
a float32 master copy that the optimizer (float32 states) updates; after each step the master is
rounded to nearest into the bf16 weight. This is the usual mixed-precision recipe (Micikevicius et
al., "Mixed Precision Training", ICLR 2018, §3.1), without loss scaling: bf16 has float32's
exponent range.

A master copy is required, not optional: the policy's learning rate is 1e-6 (SAO §3 setup), and
an AdamW update of about ``lr`` on a weight of order 1e-2 is about 1/100 of that weight's bf16
spacing (2^-13 ≈ 1.2e-4 at 0.02), so updating bf16 weights directly rounds every update away;
the master accumulates them until the bf16 weight moves.

``MasterWeights`` holds the masters of one module; ``MixedPrecisionAdamW`` is the optimizer a
learner holds instead of ``learner.models.optim.make_adamw``'s: it has the methods the learners call on
an optimizer (``zero_grad``, ``step``, ``param_groups``, ``state``, ``state_dict``), so the step
code (``learner.models.optim.optimizer_step``: backward, clip, step) is unchanged. Gradients are clipped
in bf16 on the module's parameters (the clip scales them by one factor; its norm is exact to about
3 significant digits), then moved to the masters by ``step``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from learner.models import attention
from learner.models.fused import compile_layers
from learner.models.optim import make_adamw

COMPUTE_DTYPE = torch.bfloat16


class MasterWeights:
    """Float32 master copies of a module's trainable parameters; the module computes in bf16.

    The constructor casts ``module`` in place to ``compute_dtype`` (default bf16), except the
    submodules named in ``keep_float32`` (e.g. the critic's scalar value head, whose small value
    differences need float32: ``learner.algo.critic``). Before casting, it copies every parameter with
    ``requires_grad=True`` into a float32 master tensor; frozen parameters get no master (they never
    change, and are only read in bf16). Parameters shared by two modules (tied embeddings) have one
    master.

    An optimizer is built over ``params`` (the masters, float32 leaves with ``requires_grad=True``;
    they never enter a graph); ``MixedPrecisionAdamW`` does it and runs the step: backward through
    the bf16 module, ``grads_to_master`` (bf16 → float32 gradients on the masters), the optimizer's
    update of the masters, then ``master_to_model`` (round to nearest into the bf16 weights).

    Memory per trainable parameter: 2 bytes (bf16 weight) + 2 (bf16 gradient, freed by
    ``grads_to_master``) + 4 (master) + 4 (master gradient) + 8 (AdamW moments), against 16 for a
    float32 model; a frozen parameter costs 2 bytes instead of 4. A LoRA policy (``learner.models.lora``)
    is the extreme case: the base weights are frozen (bf16, no master, no gradient) and only the
    adapter's A and B have masters and moments; they compute in bf16 like the base, and their
    masters accumulate the updates smaller than a bf16 spacing of A's entries.

    Raises (constructor): ValueError if ``module`` has no trainable parameter or a name in
    ``keep_float32`` is not a submodule.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        compute_dtype: torch.dtype = COMPUTE_DTYPE,
        keep_float32: Iterable[str] = (),
    ) -> None:
        keep = list(keep_float32)
        submodules = dict(module.named_modules())
        for name in keep:
            if name not in submodules:
                raise ValueError(f"keep_float32 names {name!r}, which is not a submodule")
        named = list(module.named_parameters())  # deduplicated: a tied weight appears once
        self.names = [n for n, p in named if p.requires_grad]
        if not self.names:
            raise ValueError("the module has no trainable parameter")
        self.module = module
        self._model_params = [p for _, p in named if p.requires_grad]
        self.params = [
            torch.nn.Parameter(p.detach().to(torch.float32, copy=True)) for p in self._model_params
        ]
        kept = {id(p) for name in keep for p in submodules[name].parameters()}
        # Parameters only: buffers (rotary inverse frequencies) stay float32, as they are inputs to
        # the model's own float32 arithmetic.
        for p in module.parameters():
            if id(p) not in kept:
                p.data = p.data.to(compute_dtype)

    def zero_grad(self) -> None:
        """Drop the gradients of the compute weights and of the masters."""
        for p in self._model_params:
            p.grad = None
        for w in self.params:
            w.grad = None

    def grads_to_master(self) -> None:
        """Move each compute weight's gradient (bf16) to its master as float32 (None stays None)."""
        for p, w in zip(self._model_params, self.params, strict=True):
            w.grad = None if p.grad is None else p.grad.to(torch.float32)
            p.grad = None

    @torch.no_grad()
    def master_to_model(self) -> None:
        """Round every master to nearest into its compute weight (in place)."""
        for p, w in zip(self._model_params, self.params, strict=True):
            p.copy_(w)

    @torch.no_grad()
    def sync_from_model(self) -> None:
        """Set every master to its compute weight's current value (exact: bf16 ⊂ float32)."""
        for p, w in zip(self._model_params, self.params, strict=True):
            w.copy_(p)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The float32 masters by parameter name (what a checkpoint must keep: the bf16 weights
        are their rounding)."""
        return {n: w.detach() for n, w in zip(self.names, self.params, strict=True)}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore masters saved by ``state_dict`` and round them into the module.

        Raises:
            ValueError: the names differ from this module's trainable parameters.
        """
        if set(state) != set(self.names):
            missing, extra = set(self.names) - set(state), set(state) - set(self.names)
            raise ValueError(f"master state mismatch: missing {sorted(missing)}, unexpected {sorted(extra)}")
        for n, w in zip(self.names, self.params, strict=True):
            w.copy_(state[n])
        self.master_to_model()


class MixedPrecisionAdamW:
    """AdamW (``learner.models.optim.make_adamw``, fused, float32 states) over the float32 masters of a
    bf16 module, presented as the module's optimizer.

    Built from the module (cast to bf16 in place by ``MasterWeights``). A caller's step is
    ``zero_grad()``, ``loss.backward()``, clipping of the module's (bf16) gradients, ``step()``:
    ``step`` moves the gradients to the masters, runs AdamW on them and rounds the masters back
    into the module. ``param_groups`` and ``state`` are the inner AdamW's (a learning-rate warm-up
    writes ``param_groups[i]["lr"]``; a rollback clears ``state``). ``state_dict`` holds the AdamW
    state and the masters, so a checkpoint of (bf16 module, this optimizer) restores the masters
    exactly, whatever the module's own state dict held.

    Args (constructor):
        module: the model; its trainable parameters get masters (``MasterWeights``).
        lr, weight_decay, beta1: as ``learner.models.optim.make_adamw``.
        keep_float32: submodule names left float32 (``MasterWeights``).
        lr_scales: as ``make_adamw``'s, one per trainable parameter of ``module`` in its order.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        lr: float,
        weight_decay: float,
        beta1: float = 0.9,
        keep_float32: Iterable[str] = (),
        lr_scales: Sequence[float] | None = None,
    ) -> None:
        self.master = MasterWeights(module, keep_float32=keep_float32)
        self.inner = make_adamw(self.master.params, lr, weight_decay, beta1, lr_scales)

    @property
    def param_groups(self) -> list[dict]:
        """The inner AdamW's parameter groups (their ``params`` are the masters)."""
        return self.inner.param_groups

    @property
    def state(self) -> dict:
        """The inner AdamW's per-parameter state (moments, step counts)."""
        return self.inner.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the module's and the masters' gradients (always set to None)."""
        self.master.zero_grad()

    def step(self) -> None:
        """Gradients to the masters, one AdamW step on them, masters rounded into the module."""
        self.master.grads_to_master()
        self.inner.step()
        self.master.master_to_model()

    def sync_from_model(self) -> None:
        """Take the masters from the module's current weights (after weights were loaded into the
        module from elsewhere, e.g. a published version; the AdamW state is kept)."""
        self.master.sync_from_model()

    def state_dict(self) -> dict:
        """``{"adamw": the inner AdamW's state dict, "master": the float32 masters by name}``."""
        return {"adamw": self.inner.state_dict(), "master": self.master.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore a ``state_dict()``: the AdamW state, then the masters (rounded into the module).

        A plain AdamW state dict (a checkpoint of a float32 learner) is accepted too: its moments
        are loaded and the masters are taken from the module (``sync_from_model``), so the caller
        loads the module's weights first, as the learners' ``load_state_dict`` do.

        Raises:
            ValueError: the masters' names differ from the module's trainable parameters.
        """
        if "master" not in state:
            self.inner.load_state_dict(state)
            self.master.sync_from_model()
            return
        self.inner.load_state_dict(state["adamw"])
        self.master.load_state_dict(state["master"])


def make_optimizer(
    module: torch.nn.Module,
    params: list[torch.nn.Parameter],
    lr: float,
    weight_decay: float,
    beta1: float,
    bf16: bool,
    keep_float32: Iterable[str] = (),
    lr_scales: Sequence[float] | None = None,
) -> torch.optim.Optimizer | MixedPrecisionAdamW:
    """The learners' optimizer for ``module``: ``learner.models.optim.make_adamw`` over ``params`` (a
    float32 module), or with ``bf16`` a ``MixedPrecisionAdamW`` over ``module``, which casts it to
    bf16 in place (``params`` are then its trainable parameters, as the caller clips them).
    ``lr_scales``: one per parameter of ``params`` (``make_adamw``)."""
    if bf16:
        return MixedPrecisionAdamW(module, lr, weight_decay, beta1, keep_float32, lr_scales)
    return make_adamw(params, lr, weight_decay, beta1, lr_scales)


def cast_parameters(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast ``model``'s parameters to ``dtype`` in place, its buffers left as they are: a frozen
    model (the KL reference) then computes as ``MasterWeights`` makes the policy compute, its
    rotary inverse frequencies float32 (``module.to(dtype)`` would round them too)."""
    for p in model.parameters():
        p.data = p.data.to(dtype)


def prepare_compute(
    model: torch.nn.Module, bf16: bool, compiled: bool, device: torch.device | None = None
) -> None:
    """Set up a model the learner runs (policy, critic, reference) for its precision: with
    ``bf16`` on the CPU (``device`` None or a CPU) attention becomes
    ``learner.models.attention.grouped_attention`` (torch's SDPA backward is slow in bf16 on CPU,
    docs/precision.md; on a GPU SDPA's fused kernels are the fast ones and stay); with
    ``compiled`` every decoder layer is compiled (``learner.models.fused``). Casting is not done here
    (``make_optimizer``, or ``cast_parameters`` for a frozen model)."""
    if bf16 and (device is None or device.type == "cpu"):
        attention.install(model)
    if compiled:
        compile_layers(model)
