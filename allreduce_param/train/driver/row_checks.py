"""The row checks ``prepare`` refuses: which conditions, and what their errors say.

A ``RowCheck`` is a condition no row may meet (its name is its count's key in the check
figures, ``row_figures.py``, and its condition's in ``_bad_rows`` there) and the
message's wording: each error names the data, the column, how many rows are bad and the
first of them, and what to do about it (drop, fill, re-index, cast). ``row_checks`` says
which apply to a fit (a classifier's labels, a model's class count, sample weights);
``refuse_bad_rows`` raises the first error a split's figures call for.
Kept apart from the pass that counts them, so the wording can be read (and changed) in one
place.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

from allreduce_param.errors import InputError
from allreduce_param.train.driver.data_pass import first_bad_row


class RowCheck(NamedTuple):
    """A condition no row may meet: its name (its count's key in the statistics, and its
    condition's in ``_bad_rows``) and the message's wording."""

    name: str
    message: object  # (data name, features_col, label_col, classes, stats) -> str


def row_checks(
    classification: bool, classes: int | None, weight_col: str | None = None
) -> list[RowCheck]:
    """The row conditions ``prepare`` refuses, in the order it reports them.

    Features: NaN, +/-Inf or null elements (a double beyond float32's range became Inf when
    the column was cast). Labels: +/-Inf (null and NaN are counted apart, as before); for a
    classifier also fractional, negative, and (when the model says) >= its class count.
    Weights (with ``weight_col``): null, NaN, negative or +/-Inf.
    """
    checks = [
        RowCheck("nonfinite_features", _nonfinite_features),
        RowCheck("infinite_labels", _infinite_labels),
    ]
    if classification:
        checks += [
            RowCheck("fractional_labels", _fractional_labels),
            RowCheck("negative_labels", _negative_labels),
        ]
        if classes is not None:
            checks.append(RowCheck("too_large_labels", _too_large_labels))
    if weight_col is not None:
        checks.append(RowCheck("bad_weights", functools.partial(_bad_weights, weight_col)))
    return checks


def refuse_bad_rows(
    name: str,
    stats: dict | None,
    features_col: str,
    label_col: str,
    checks: list[RowCheck],
    classes: int | None,
    weight_col: str | None,
) -> None:
    """The first ``InputError`` the ``name`` data's merged figures (``stats``, None: no
    rows) call for, in the order every fit reports them: no rows, null or NaN labels, null
    features, bad sparse indices, vectors of different lengths, each of ``checks``, weights
    that sum to 0; nothing where the rows pass."""
    if stats is None or stats["rows"] == 0:
        raise InputError(f"the {name} data has no rows")
    if stats["bad_labels"]:
        raise InputError(
            f"the {name} data has {stats['bad_labels']} rows whose label {label_col!r} is null or NaN; "
            f"drop or fill them first, e.g. df.dropna(subset=[{label_col!r}])"
        )
    if stats["missing_features"]:
        raise InputError(
            f"the {name} data has {stats['missing_features']} rows whose {features_col!r} is "
            f"null (e.g. row {first_bad_row(stats, 'missing_features')}); drop them first, "
            f"e.g. df.dropna(subset=[{features_col!r}]), or fill them where they come from "
            "(VectorAssembler(handleInvalid='keep') keeps NaN in a vector instead)"
        )
    if stats["bad_indices"]:
        raise InputError(bad_indices_message(name, features_col, stats))
    if stats["shortest"] != stats["longest"]:
        raise InputError(
            f"the {name} column {features_col!r} holds vectors of {stats['shortest']} to "
            f"{stats['longest']} elements (e.g. row {first_bad_row(stats, 'shortest')}: "
            f"{stats['shortest']}, row {first_bad_row(stats, 'longest')}: "
            f"{stats['longest']}); every row needs the same length"
        )
    for check in checks:
        if stats[check.name]:
            raise InputError(check.message(name, features_col, label_col, classes, stats))
    if weight_col is not None:
        check_weight_sum(name, weight_col, stats)


def _nonfinite_features(name, features_col, label_col, classes, stats) -> str:
    example = stats["nonfinite_features_first"]["value"]
    return (
        f"the {name} column {features_col!r} holds NaN, Inf or null in {stats['nonfinite_features']} rows "
        f"(e.g. row {first_bad_row(stats, 'nonfinite_features')}: {_number(example['value'])} at element "
        f"{example['index']}); drop or fill them before training: df.na.drop() or "
        "pyspark.ml.feature.Imputer on the input columns (before VectorAssembler) for NaN and null, and "
        "filter out or replace infinite values (a number beyond float32's +-3.4e38 becomes Inf too)"
    )


def bad_indices_message(name, features_col, stats) -> str:
    example = stats["bad_indices_first"]["value"]
    shown = ", ".join(map(str, example["indices"])) + (", ..." if example["count"] > 8 else "")
    return (
        f"the {name} column {features_col!r} holds sparse vectors whose indices are out of range, "
        f"out of order or not one per value in {stats['bad_indices']} rows (e.g. row "
        f"{first_bad_row(stats, 'bad_indices')}: size {example['size']}, {example['count']} indices "
        f"[{shown}] for {example['values']} values); a sparse vector's indices must be strictly "
        "increasing, each in 0..size-1, one per value: build it with Vectors.sparse(size, indices, "
        "values), which checks them"
    )


def _infinite_labels(name, features_col, label_col, classes, stats) -> str:
    return (
        f"the {name} data has {stats['infinite_labels']} rows whose label {label_col!r} is infinite "
        f"({_example(stats, 'infinite_labels')}); drop or fix them first, e.g. "
        f"df.filter(F.abs({label_col!r}) < float('inf'))"
    )


def _fractional_labels(name, features_col, label_col, classes, stats) -> str:
    return (
        f"the {name} data has {stats['fractional_labels']} rows whose label {label_col!r} is not a whole "
        f"number ({_example(stats, 'fractional_labels')}), but a classification model takes class ids "
        "0, 1, 2, ...: index the classes with pyspark.ml.feature.StringIndexer, or fit a regression model"
    )


def _negative_labels(name, features_col, label_col, classes, stats) -> str:
    return (
        f"the {name} data has {stats['negative_labels']} rows whose label {label_col!r} is negative "
        f"({_example(stats, 'negative_labels')}), but a classification model takes class ids 0, 1, 2, ...: "
        "re-index the classes with pyspark.ml.feature.StringIndexer"
    )


def _too_large_labels(name, features_col, label_col, classes, stats) -> str:
    largest = int(stats["too_large_labels_largest"])
    return (
        f"the {name} data has {stats['too_large_labels']} rows whose label {label_col!r} is {classes} or "
        f"more ({_example(stats, 'too_large_labels')}; the largest is {largest}), but the model has "
        f"{classes} classes (ids 0..{classes - 1}): use a model with {largest + 1} outputs (e.g. "
        f"MLP([..., {largest + 1}]) or SoftmaxRegression(n_features, {largest + 1})), or re-index the "
        "classes with pyspark.ml.feature.StringIndexer"
    )


def _bad_weights(weight_col, name, features_col, label_col, classes, stats) -> str:
    return (
        f"the {name} data has {stats['bad_weights']} rows whose weight {weight_col!r} (weight_col) is null, NaN, "
        f"negative or infinite ({_example(stats, 'bad_weights')}); a weight must be a finite number >= 0: "
        f"fill them, e.g. df.fillna(1.0, subset=[{weight_col!r}]) for null and NaN, or filter them out, e.g. "
        f"df.filter((F.col({weight_col!r}) >= 0) & (F.col({weight_col!r}) < float('inf')))"
    )


def check_weight_sum(name: str, weight_col: str, stats: dict) -> None:
    """Refuse a split whose weights (each finite and >= 0) sum to 0, or beyond float64."""
    total = stats["weight_sum"]
    if total == 0:
        raise InputError(
            f"the {name} data's weights in {weight_col!r} (weight_col) sum to 0: all its {stats['rows']} rows "
            "have weight 0, so no row counts (a weighted mean over them is 0/0); at least one row needs a "
            "weight > 0"
        )
    if not math.isfinite(total):
        raise InputError(
            f"the {name} data's weights in {weight_col!r} (weight_col) sum to more than a float64 holds "
            "(about 1.8e308); scale them down: only their ratios matter"
        )


def _example(stats: dict, check: str) -> str:
    return f"e.g. {_number(stats[check + '_first']['value'])} at row {first_bad_row(stats, check)}"


def _number(value) -> str:
    """A value as a message shows it: NaN, Inf, -Inf, null, whole numbers without '.0'."""
    if value is None:
        return "null"
    value = float(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "Inf" if value > 0 else "-Inf"
    return str(int(value)) if value.is_integer() else repr(value)
