"""vLLM's sampling parameters for one request, from the one sampling record the server logs
(``core.records.SamplingRecord``; docs/design.md §7.2)."""

from __future__ import annotations

from core.records import SamplingRecord


class InvalidSampling(ValueError):
    """vLLM refused a request's sampling parameters (its own checks, ``SamplingParams``); the
    text is vLLM's message."""


def vllm_sampling(sampling: SamplingRecord, top_logprobs: int = 0, ignore_eos: bool = False):
    """vLLM's ``SamplingParams`` for one request drawn as ``sampling`` says, streamed as deltas,
    with the processed logprob of each sampled token and of its ``top_logprobs`` (0..20) most
    likely alternatives. ``ignore_eos``: sample through the end-of-sequence token up to
    ``max_tokens`` (measurements that need answers of one length; never an answer the server
    serves). A new object each call: ``sampling`` is not changed (docs/design.md §7.2).

    Raises InvalidSampling when vLLM's checks refuse the values.
    """
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import RequestOutputKind

    try:
        return SamplingParams(
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            max_tokens=sampling.max_tokens,
            seed=sampling.seed,
            stop=list(sampling.stop or []),  # a copy: vLLM keeps the list it is given
            ignore_eos=ignore_eos,
            logprobs=top_logprobs,
            output_kind=RequestOutputKind.DELTA,
        )
    except (ValueError, VLLMValidationError) as exc:
        raise InvalidSampling(str(exc)) from exc
