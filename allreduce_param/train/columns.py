"""The columns of the rows the driver hands a fit's tasks: what each holds, and the split
codes (which rows train, which validate). The driver writes them (``driver.data.prepare``),
each task reads them (``rows.arrays_from_arrow``)."""

from __future__ import annotations

#: A training row's and a validation row's value in the ``split`` column.
TRAIN, VALIDATION = 0, 1
#: The columns a prepared DataFrame has, and their Spark types; prepared with ``weight_col``
#: it has a fourth after them, ``WEIGHT_COLUMN double`` (``prepared_columns`` lists them).
PREPARED_SCHEMA = "features array<float>, label double, split int"
#: The prepared column of sample weights (float64), where the data has them.
WEIGHT_COLUMN = "weight"
#: The columns a shuffled placement adds (``partitioning.place_rows``): a partition's rows
#: belong in (split, _order, _i) order. A shuffle delivers them in no fixed order, and
#: ``arrays_from_arrow`` sorts the keys in numpy for less than Spark's sort of whole rows.
ORDER_COLUMNS = ("_order", "_i")


def prepared_columns(weighted: bool = False) -> tuple[str, ...]:
    """The columns of a prepared DataFrame, in order: ``features, label, split``, then
    ``weight`` for data prepared with ``weight_col`` (``data.DataSummary.weighted``)."""
    return (
        ("features", "label", "split", WEIGHT_COLUMN)
        if weighted
        else ("features", "label", "split")
    )
