"""The base model's share of each style under the SAO system prompt (issue 5, docs/design.md §6).

Before choosing a schedule, measure what the untrained policy writes: for each candidate set
of offered styles, ``--n`` random writing requests go to the served model (vLLM, the serving
dtype and sampling settings: temperature 1.0, top-p 1, ``--max-tokens`` new tokens) with
``system_prompt(styles)``, and the offline judge detects each answer's style. A target whose
base share is near zero gets almost no reward, so a policy cannot learn to prefer it within a
short run (SAO §3.4: the reward is ``quality × [style == target]``).

Prints a Markdown table: one row per offered set, columns = detected-style shares (and the
quality pass rate).

    .venv/bin/python bench/base_style_shares.py --sets poetic,cute poetic,casual --n 96

Runs offline; about 1 min per set of 96 answers on 2 CPU cores after a 30 s engine start.
"""

from __future__ import annotations

import argparse
import os
import random
from collections import Counter

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sets", nargs="+", default=["poetic,cute", "cute,chuunibyou,classical"])
    parser.add_argument("--n", type=int, default=96, help="Answers per offered set.")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from vllm import LLM, SamplingParams

    from core.settings import get_settings
    from judge.offline import OfflineJudge
    from judge.styles import STYLE_NAMES, system_prompt, writing_requests
    from saoserve.model import prepare_model

    settings = get_settings()
    model_dir = prepare_model(settings.resolved_model_dir)
    llm = LLM(
        model=str(model_dir),
        dtype=settings.dtype,
        enforce_eager=True,
        max_model_len=settings.max_model_len,
        kv_cache_memory_bytes=int(settings.kv_cache_gib * (1 << 30)),
        seed=args.seed,
        enable_chunked_prefill=False,  # as the server: seeded requests crash chunked prefills on CPU
    )
    judge = OfflineJudge()
    requests = writing_requests()
    rng = random.Random(args.seed)
    rows = []
    for spec in args.sets:
        styles = [s.strip() for s in spec.split(",")]
        system = system_prompt(styles)
        picked = [rng.choice(requests) for _ in range(args.n)]
        chats = [[{"role": "system", "content": system}, {"role": "user", "content": r}] for r in picked]
        params = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=args.max_tokens, seed=args.seed)
        outs = llm.chat(chats, params, use_tqdm=False)
        answers = [o.outputs[0].text for o in outs]
        verdicts = judge.judge_many([(r, a, styles[0]) for r, a in zip(picked, answers, strict=True)])
        counts = Counter(v.style for v in verdicts)
        quality = sum(v.quality for v in verdicts) / len(verdicts)
        rows.append((spec, counts, quality))
    print(f"n = {args.n} answers per set, max_tokens {args.max_tokens}, temperature 1.0\n")
    print("| offered | " + " | ".join(STYLE_NAMES) + " | quality |")
    print("|---" * (len(STYLE_NAMES) + 2) + "|")
    for spec, counts, quality in rows:
        shares = " | ".join(f"{counts.get(s, 0) / args.n:.2f}" for s in STYLE_NAMES)
        print(f"| {spec} | {shares} | {quality:.2f} |")


if __name__ == "__main__":
    main()
