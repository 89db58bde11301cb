"""server/engine/sampling.py ``vllm_sampling``: the one sampling record → vLLM's parameters (values
carried, the record untouched, vLLM's refusals named), and the record's ``stop`` in the log."""

from __future__ import annotations

import pytest

from core.records import SamplingRecord
from server.engine import InvalidSampling, vllm_sampling


def test_the_records_values_are_carried_and_the_record_is_not_changed():
    from vllm.sampling_params import RequestOutputKind

    rec = SamplingRecord(temperature=0.7, top_p=0.9, top_k=5, max_tokens=12, seed=3, stop=["END", "\n\n"])
    before = rec.model_dump()
    params = vllm_sampling(rec, top_logprobs=2)
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens, params.seed) == (
        0.7,
        0.9,
        5,
        12,
        3,
    )
    assert params.stop == ["END", "\n\n"] and params.stop is not rec.stop
    # Streamed as deltas, with the sampled token's logprob and 2 alternatives; the EOS ends it.
    assert (params.output_kind, params.logprobs, params.ignore_eos) == (RequestOutputKind.DELTA, 2, False)
    assert rec.model_dump() == before
    # A new object each call: one request's parameters are never another's.
    again = vllm_sampling(rec, top_logprobs=0, ignore_eos=True)
    assert again is not params and (again.logprobs, again.ignore_eos, params.logprobs) == (0, True, 2)


def test_a_record_without_stop_strings_has_none():
    params = vllm_sampling(SamplingRecord(temperature=1.0, max_tokens=4))
    assert (params.stop, params.top_p, params.top_k, params.seed, params.logprobs) == ([], 1.0, 0, None, 0)


@pytest.mark.parametrize(
    ("rec", "message"),
    [
        (SamplingRecord(temperature=2.5, max_tokens=4), "temperature must be in [0, 2], got 2.5."),
        (SamplingRecord(temperature=1.0, top_k=-2, max_tokens=4), "top_k must be 0 (disable), or at least 1"),
        (SamplingRecord(temperature=1.0, top_p=0.0, max_tokens=4), "top_p must be in (0, 1], got 0.0."),
    ],
)
def test_vllms_refusal_is_invalid_sampling_with_its_message(rec, message):
    with pytest.raises(InvalidSampling) as exc:
        vllm_sampling(rec)
    assert str(exc.value).startswith(message)


def test_stop_is_logged_only_when_given():
    """A record without stop strings is the JSON records had before the field; with them, they
    round-trip."""
    assert SamplingRecord(temperature=1.0, max_tokens=4).model_dump_json() == (
        '{"temperature":1.0,"top_p":1.0,"top_k":0,"max_tokens":4,"seed":null}'
    )
    rec = SamplingRecord(temperature=1.0, max_tokens=4, stop=["END"])
    assert rec.model_dump_json().endswith(',"stop":["END"]}')
    assert SamplingRecord.model_validate_json(rec.model_dump_json()) == rec
    # A NUL is a character a stop string may hold (server.schemas): escaped in the JSON, which a
    # PostgreSQL text column can store.
    nul = SamplingRecord(temperature=1.0, max_tokens=4, stop=["\x00"]).model_dump_json()
    assert nul.endswith(r',"stop":["\u0000"]}') and "\x00" not in nul
