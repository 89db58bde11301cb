"""Whether this machine's CPU has bf16 matrix units, so that a bf16 matmul is the fast one.

PyTorch's CPU bf16 matmul (oneDNN) runs on AMX-BF16 tiles or on AVX512-BF16 dot-product
instructions. A CPU with neither (AVX2 only) takes a fallback path that is hundreds of times
slower than float32, not faster (docs/precision.md, "CPUs without bf16 units"). So the learner's
precision is chosen per machine (``learner.config.PRESETS``), and a process asked for bf16 on
such a CPU says what it costs (``bf16_warning``).
"""

from __future__ import annotations

import torch


def bf16_native() -> bool:
    """True when this CPU has bf16 matrix instructions: AMX-BF16 tiles or AVX512-BF16.

    Read through ``torch.cpu``'s capability checks (the CPUID bits oneDNN dispatches on), so it
    is exact and costs no measurement. A CPU with AVX-512 but without its BF16 extension counts
    as not native: oneDNN emulates bf16 there, at no gain over float32.
    """
    return bool(torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported())


def bf16_warning(what: str) -> str | None:
    """The warning a process logs when ``what`` (e.g. "the learner's bf16 models") computes in
    bf16 on a CPU without bf16 units; None where the CPU has them.

    Not an error: bf16 stays correct there, and tests run it on tiny models on every machine.
    """
    if bf16_native():
        return None
    return (
        f"{what} compute in bf16 on a CPU without bf16 matrix units (neither AMX-BF16 nor "
        f"AVX512-BF16; torch reports {torch.backends.cpu.get_cpu_capability()}): bf16 matmuls run "
        "hundreds of times slower than float32 here (docs/precision.md, 'CPUs without bf16 units')"
    )


def cuda_bf16() -> bool:
    """True when a CUDA GPU is visible and supports bf16 (compute capability 8.0 or newer, where
    a bf16 matmul runs at the tensor cores' full rate): the learner's fast bf16 on a GPU."""
    return torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
