"""vLLM worker extension: reload policy weights from a directory, lm_head included.

Loaded into vLLM's workers by ``worker_extension_cls``. On the CPU build with tied
embeddings, ``reload_weights`` updates the embedding tensor but not the packed ``lm_head``
kernel built from it at load time, so outputs would come from the new body with the old head
(docs/design.md §7, a fault checked on these machines). Re-running the LM head's
``process_weights_after_loading`` after the reload rebuilds it.
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
