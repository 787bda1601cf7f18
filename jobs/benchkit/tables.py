"""Tables as the benchmarks print them: markdown, sizes as 10K/1M, milliseconds and ratios."""

from __future__ import annotations

import re
import statistics


def ratio_text(ours: list[float], gloo: list[float]) -> str:
    """The median of the per-round ratios ours/gloo, with their range ('' without gloo)."""
    if not gloo or len(gloo) != len(ours):
        return ""
    ratios = [a / b for a, b in zip(ours, gloo)]
    return f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"


def ms_text(ms: float) -> str:
    """Milliseconds as a table shows them: one decimal from 10 ms, two from 1 ms, else three digits."""
    return f"{ms:,.1f}" if ms >= 10 else f"{ms:.2f}" if ms >= 1 else f"{ms:.3g}"


def render(header: tuple, lines: list, left: int = 2) -> str:
    """A markdown table; the first ``left`` columns flush left, the others right."""
    widths = [max(len(str(line[i])) for line in [header, *lines]) for i in range(len(header))]

    def show(line):
        return (
            "| "
            + " | ".join(
                str(cell).ljust(width) if i < left else str(cell).rjust(width)
                for i, (cell, width) in enumerate(zip(line, widths))
            )
            + " |"
        )

    return "\n".join(
        [show(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(show, lines)]
    )


def label(size: int) -> str:
    """``10_000`` -> ``'10K'``, ``10_000_000`` -> ``'10M'``."""
    for factor, suffix in ((1_000_000, "M"), (1_000, "K")):
        if size >= factor and size % factor == 0:
            return f"{size // factor}{suffix}"
    return str(size)


def parse_sizes(text: str) -> list[int]:
    """``'10K,1M,10000000'`` -> ``[10000, 1000000, 10000000]`` (K and M as :func:`label` prints them)."""
    sizes = []
    for part in text.split(","):
        found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*", part)
        if not found:
            raise SystemExit(
                f"cannot read size {part!r}: write float32 elements, e.g. 10000, 10K, 1M"
            )
        sizes.append(
            int(float(found.group(1)) * {"": 1, "k": 1_000, "m": 1_000_000}[found.group(2).lower()])
        )
    return sizes
