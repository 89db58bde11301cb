"""Reading a Prometheus text exposition in a test."""

from __future__ import annotations


def metric(body: str, name: str, **labels: str) -> float:
    """The value of one sample in a Prometheus text exposition (0 when absent); the exposition
    writes labels in name order."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    line = f"{name}{{{want}}} " if want else f"{name} "
    for row in body.splitlines():
        if row.startswith(line):
            return float(row.split()[-1])
    return 0.0
