"""The learner's models and where they run: ``placement`` (one device, or N ranks with FSDP2),
``device`` (the configured device), ``precision`` (bf16 compute, float32 master weights; with
``attention`` and ``fused``, the CPU kernels it runs on), ``lora`` (a LoRA adapter on the policy),
``optim`` (AdamW and the clipped step) and ``flops`` (a step's floating-point operations)."""
