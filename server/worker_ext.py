"""vLLM worker extension: reload policy weights (lm_head included) and choose the CPU LoRA op.

Loaded into vLLM's workers by ``worker_extension_cls``; its methods are called through
``collective_rpc``, in the worker process, where the model lives.

On the CPU build with tied embeddings, ``reload_weights`` updates the embedding tensor but not the
packed ``lm_head`` kernel built from it at load time, so outputs would come from the new body with
the old head (docs/design.md §7, a fault checked on these machines). Re-running the LM head's
``process_weights_after_loading`` after the reload rebuilds it.

On the CPU build with LoRA, ``use_lora_op`` puts the grouped LoRA op (``server.grouped_lora``,
issue 39) in place of vLLM's per-token one, for the pinned vLLM only (docs/serving_adapters.md).
"""

from __future__ import annotations


class PolicyReloadExtension:
    """Methods added to each vLLM worker; called through ``collective_rpc``."""

    def reload_policy(self, weights_path: str) -> None:
        """Load every tensor of the safetensors files in ``weights_path`` in place.

        Raises whatever vLLM's loader raises for a missing or malformed file; the engine keeps
        the old weights only if the failure happens before any tensor is copied, so the caller
        verifies the checksum first.
        """
        self.reload_weights(weights_path=weights_path)
        model = self.model_runner.get_model()
        lm_head = getattr(model, "lm_head", None)
        quant_method = getattr(lm_head, "quant_method", None)
        if quant_method is not None and hasattr(quant_method, "process_weights_after_loading"):
            quant_method.process_weights_after_loading(lm_head)

    def use_lora_op(self, op: str) -> tuple[str, str]:
        """Serve LoRA with ``op`` (a ``server.grouped_lora.LoraOp`` value) from the next step on.

        The model's LoRA layers share one Punica wrapper; ``grouped`` turns vLLM's CPU wrapper
        into ``GroupedPunicaWrapperCPU`` in place, ``stock`` turns it back. Installing the
        grouped op is refused, and vLLM's own op kept, unless ``server.grouped_lora.refusal``
        allows it (the pinned vLLM, the CPU platform) and the wrapper is vLLM's CPU one: a
        version the op was not checked against serves correctly, only slower, rather than not
        at all. Returns ``(op in effect, why)``; ``why`` is empty when ``op`` was installed.
        Raises ValueError for an unknown ``op``.
        """
        import vllm
        from vllm.platforms import current_platform

        from server.grouped_lora import LoraOp, refusal

        wanted = LoraOp(op)
        layers = self.model_runner.get_model().modules()
        wrappers = {id(w): w for m in layers if (w := getattr(m, "punica_wrapper", None)) is not None}
        if not wrappers:
            return LoraOp.STOCK.value, "the engine has no LoRA layers"
        why = refusal(vllm.__version__, current_platform.is_cpu())
        if why is not None:
            return LoraOp.STOCK.value, why
        from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

        from server.grouped_punica import GroupedPunicaWrapperCPU

        known = (PunicaWrapperCPU, GroupedPunicaWrapperCPU)
        others = sorted({type(w).__name__ for w in wrappers.values() if type(w) not in known})
        if others:
            return (
                LoraOp.STOCK.value,
                f"the LoRA layers use {', '.join(others)}, not vLLM's CPU Punica wrapper",
            )
        cls = GroupedPunicaWrapperCPU if wanted is LoraOp.GROUPED else PunicaWrapperCPU
        for w in wrappers.values():
            w.__class__ = cls
            if cls is GroupedPunicaWrapperCPU:
                w.forget_groups()  # the stock class updated the metadata without them
        return wanted.value, ""
