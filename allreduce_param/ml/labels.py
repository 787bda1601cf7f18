"""How many classes a label column makes: what its ML metadata says, else the largest label + 1,
inferred only up to MLlib's limit, so that one stray label cannot make a model of a billion
classes on the driver. Shared by every classifier of ``allreduce_param.ml``."""

from __future__ import annotations

from allreduce_param.errors import InputError

#: The most classes a classifier infers from the largest label without the label column's
#: metadata saying how many there are (MLlib refuses more than this too): a stray label such
#: as 1e9 would otherwise make a model with a billion outputs, on the driver first.
MAX_INFERRED_CLASSES = 1000


def inferred_class_count(largest: float, label_col: str) -> int:
    """The class count the largest label gives (largest + 1), refused over
    ``MAX_INFERRED_CLASSES`` before any model is made, naming what to do."""
    count = int(largest) + 1
    if count > MAX_INFERRED_CLASSES:
        raise InputError(
            f"the largest label in {label_col!r} (labelCol) is {largest:g}, which would make "
            f"a model of {count:,} classes; without the label column's metadata at most "
            f"{MAX_INFERRED_CLASSES:,} classes are inferred from the labels (as MLlib does). "
            "A stray label? Filter it out. Truly that many classes: index the labels with "
            "StringIndexer, or state the count in the column's metadata, e.g. "
            f"df.withColumn({label_col!r}, F.col({label_col!r}).alias({label_col!r}, "
            "metadata={'ml_attr': {'type': 'nominal', 'num_vals': N}}))"
        )
    return count
