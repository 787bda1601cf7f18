"""The rows of ``bench_allreduce.py``'s table, one a sync (the engine's, MLlib's, gloo's), and
the tables printed from them: medians over the rounds, the median of the per-round ratios to
gloo with their range, and, for shaped links, the ring bound."""

from __future__ import annotations

import statistics
import sys

from benchkit.links import HOST, bits_per_second, ring_bound_ms
from benchkit.rounds import PHASES
from benchkit.tables import label, ms_text, ratio_text, render

# A row is a dict that json can carry from a run in a namespace to the run that started it:
# link, size, partitions, sync (its name), kind (engine | mllib | gloo), rounds (the
# engine's (median, phases) per round), gloo (gloo's ms per round), tree (treeAggregate's ms).


def engine_row(
    link: str, size: int, partitions: int, name: str, rounds: list, gloo: list, tree=None
) -> dict:
    return dict(
        link=link,
        size=size,
        partitions=partitions,
        sync=name,
        kind="engine",
        rounds=[[total, list(phases)] for total, phases in rounds],
        gloo=list(gloo),
        tree=tree,
    )


def gloo_row(link: str, size: int, partitions: int, gloo: list, tree=None) -> dict:
    return dict(
        link=link,
        size=size,
        partitions=partitions,
        sync="gloo all_reduce (torch)",
        kind="gloo",
        rounds=None,
        gloo=list(gloo),
        tree=tree,
    )


def mllib_row(link: str, size: int, partitions: int, gloo: list, tree: float) -> dict:
    return dict(
        link=link,
        size=size,
        partitions=partitions,
        sync="MLlib broadcast+treeAggregate",
        kind="mllib",
        rounds=None,
        gloo=list(gloo),
        tree=tree,
    )


def row_totals(row: dict) -> list[float] | None:
    """The row's figure per round (None when it has none: gloo not installed)."""
    if row["kind"] == "engine":
        return [total for total, _ in row["rounds"]]
    if row["kind"] == "gloo":
        return row["gloo"] or None
    return [row["tree"]] * max(1, len(row["gloo"]))


def row_phases(row: dict) -> list[str]:
    """The median over the rounds of each phase's figure, as text ('' but for the engine)."""
    if row["kind"] != "engine":
        return [""] * len(PHASES)
    return [
        f"{statistics.median(phases[i] for _, phases in row['rounds']):,.1f}"
        for i in range(len(PHASES))
    ]


def print_table(rows: list[dict], with_link: bool = False) -> None:
    """One line a sync: medians over the rounds, and the median of the per-round ratios to gloo
    (with their range), so that the machine's drift between rounds cancels out. With
    ``with_link``, a ``link`` column first and, for shaped links, the ring bound and the ratio
    to it."""
    links = [row for row in rows if row["link"] != HOST]
    # no treeAggregate in a namespace: no column
    trees = any(row["tree"] for row in rows) or not links
    header = (
        *(("link",) if with_link else ()),
        "size",
        "sync",
        "median ms",
        *(f"{p} ms" for p in PHASES),
        "x gloo (range)",
        *(("faster than treeAgg",) if trees else ()),
        *(("ring bound ms", "x bound") if links else ()),
    )
    lines = []
    for row in rows:
        start = (row["link"],) if with_link else ()
        totals = row_totals(row)
        if totals is None:
            lines.append(
                (
                    *start,
                    label(row["size"]),
                    row["sync"],
                    "not installed",
                    *row_phases(row),
                    "",
                    *(("",) if trees else ()),
                    *(("", "") if links else ()),
                )
            )
            continue
        value = statistics.median(totals)
        tree = row["tree"]
        bound = ()
        if links:
            bound = ("", "")
            if row["link"] != HOST:
                ms = ring_bound_ms(
                    4 * row["size"], row["partitions"], bits_per_second(row["link"]) / 8
                )
                bound = (ms_text(ms), f"{value / ms:.2f}")
        lines.append(
            (
                *start,
                label(row["size"]),
                row["sync"],
                f"{value:,.1f}",
                *row_phases(row),
                ratio_text(totals, row["gloo"]),
                *((f"{tree / value:.1f}x" if tree else "",) if trees else ()),
                *bound,
            )
        )
    print(render(header, lines, left=3 if with_link else 2))
    if links:
        counts = sorted({row["partitions"] for row in links})
        print(
            f"ring bound: 2(N-1)/N x fp32 bytes / link rate (N = {', '.join(map(str, counts))}), what each "
            "partition sends on a link of its own; here all N partitions share the one shaped loopback, "
            "so nothing goes below N x the bound (x bound = N is the link's full rate)."
        )
    sys.stdout.flush()


def print_encryption_table(engine: dict) -> None:
    """Plain TCP against encrypted TCP, for every size, codec and loop measured both ways:
    their medians over the rounds, and the median of the per-round ratios with their range
    (both ran in the same barrier stage of each round, so the machine's drift cancels)."""
    lines = []
    for (size, codec, transport, loop), sealed in engine.items():
        plain = engine.get((size, codec, "tcp", loop))
        if transport != "tcp-encrypted" or plain is None:
            continue
        ratios = [s / p for (s, _), (p, _) in zip(sealed, plain)]
        plain_ms, sealed_ms = (
            statistics.median(total for total, _ in rounds) for rounds in (plain, sealed)
        )
        lines.append(
            (
                label(size),
                codec + (f", {loop} loop" if len({key[3] for key in engine}) > 1 else ""),
                ms_text(plain_ms),
                ms_text(sealed_ms),
                f"{sealed_ms - plain_ms:+.2f}",
                f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})",
            )
        )
    if lines:
        print(
            "\nencryption in transit (a step's median ms over TCP, without and with encrypt=True):"
        )
        print(
            render(
                ("size", "codec", "tcp ms", "tcp-encrypted ms", "difference ms", "x tcp (range)"),
                lines,
            )
        )
        sys.stdout.flush()
