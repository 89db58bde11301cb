"""Accuracy of the offline judge on the held-out labelled set (docs/design.md §6; SAO §3.4 judge).

Prints, as Markdown: the style confusion matrix (rows: labelled style, columns: detected
style), accuracy, per-style precision and recall, the embedding-only accuracy (lexical weight
0, for comparison), the quality pass rate of the labelled answers with their own requests
(should be near 1), and with a mismatched request (answer i judged against the request of
answer i + n/2; lower is better, though some pairs share a topic).

    .venv/bin/python bench/judge_accuracy.py [--update-docs docs/judge.md]

``--update-docs`` replaces the block between the ``judge_accuracy`` markers in that file.
Runs offline (about 40 s on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from judge.offline import OfflineJudge  # noqa: E402  (the offline flag must be set first)
from judge.styles import STYLE_NAMES, labelled  # noqa: E402

START = "<!-- judge_accuracy:start -->"
END = "<!-- judge_accuracy:end -->"


def confusion(gold: list[str], pred: list[str], styles: list[str]) -> list[list[int]]:
    """``m[i][j]`` = number of texts labelled ``styles[i]`` detected as ``styles[j]``."""
    m = [[0] * len(styles) for _ in styles]
    for g, p in zip(gold, pred, strict=True):
        m[styles.index(g)][styles.index(p)] += 1
    return m


def accuracy(gold: list[str], pred: list[str]) -> float:
    """Share of texts whose detected style is the labelled one."""
    return sum(g == p for g, p in zip(gold, pred, strict=True)) / len(gold)


def markdown(gold: list[str], pred: list[str], styles: list[str]) -> str:
    """The confusion matrix and per-style precision/recall as Markdown tables."""
    m = confusion(gold, pred, styles)
    lines = [
        "| labelled \\ detected | " + " | ".join(styles) + " | recall |",
        "|---" * (len(styles) + 2) + "|",
    ]
    for i, s in enumerate(styles):
        recall = m[i][i] / max(1, sum(m[i]))
        lines.append(f"| **{s}** | " + " | ".join(str(v) for v in m[i]) + f" | {recall:.2f} |")
    precision = [m[j][j] / max(1, sum(m[i][j] for i in range(len(styles)))) for j in range(len(styles))]
    lines.append("| precision | " + " | ".join(f"{p:.2f}" for p in precision) + " | |")
    return "\n".join(lines)


def run() -> str:
    """Judge the labelled set and return the Markdown report."""
    data = labelled()
    texts = [x["text"] for x in data]
    gold = [x["style"] for x in data]
    requests = [x["request"] for x in data]
    styles = list(STYLE_NAMES)
    judge = OfflineJudge()
    verdicts = judge.judge_many([(r, t, g) for r, t, g in zip(requests, texts, gold, strict=True)])
    pred = [v.style for v in verdicts]
    emb_only = OfflineJudge(lexical_weight=0.0).style_scores(texts, judge.embed(requests), judge.embed(texts))
    pred_emb = [max(s, key=s.__getitem__) for s in emb_only]
    n = len(data)
    shifted = [(i + n // 2) % n for i in range(n)]
    mismatched = [
        (requests[k], texts[i], gold[i]) for i, k in enumerate(shifted) if requests[k] != requests[i]
    ]
    off = judge.judge_many(mismatched)
    counts = {s: gold.count(s) for s in styles}
    return "\n".join(
        [
            f"Labelled set: {n} texts ({', '.join(f'{s} {c}' for s, c in counts.items())}); "
            f"judge: `OfflineJudge()` defaults (lexical weight {judge.lexical_weight}, on-topic "
            f"threshold {judge.on_topic_threshold}).",
            "",
            markdown(gold, pred, styles),
            "",
            f"- **Style accuracy: {accuracy(gold, pred):.3f}** ({sum(g == p for g, p in zip(gold, pred, strict=True))}/{n})",
            f"- Embedding only (lexical weight 0): {accuracy(gold, pred_emb):.3f}",
            f"- Quality 1 with the answer's own request: {sum(v.quality for v in verdicts) / n:.3f}",
            f"- Quality 1 with a mismatched request (off-topic probe, lower is better): "
            f"{sum(v.quality for v in off) / len(off):.3f} of {len(off)}",
            f"- Reward 1 with own request and target = labelled style: {sum(v.reward for v in verdicts) / n:.3f}",
        ]
    )


def update_docs(path: Path, report: str) -> None:
    """Replace the marked block of ``path`` with ``report``; raise ``ValueError`` without markers."""
    text = path.read_text(encoding="utf-8")
    pattern = re.compile(re.escape(START) + ".*?" + re.escape(END), re.DOTALL)
    if not pattern.search(text):
        raise ValueError(f"{path} has no {START} ... {END} block")
    path.write_text(pattern.sub(lambda _: f"{START}\n{report}\n{END}", text), encoding="utf-8")


def main() -> None:
    """Print the report; with ``--update-docs FILE`` also write it into FILE's marked block."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--update-docs", type=Path, help="Markdown file with judge_accuracy markers")
    args = ap.parse_args()
    report = run()
    print(report)
    if args.update_docs:
        update_docs(args.update_docs, report)
        print(f"\nupdated {args.update_docs}", file=sys.stderr)


if __name__ == "__main__":
    main()
