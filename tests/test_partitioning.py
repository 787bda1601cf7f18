"""Data-partition schemes on real Spark (local[4]): which rows each worker gets, and in which order.

Every input row carries its identity: a training row's label is its index i in the input's
order (partition by partition, row by row), a validation row's label is 100 + i, and its
first feature repeats the label (so features travel with their row); in weighted data its
weight is ``weight_of(label)`` (so weights travel with their row too). The expected placement
is computed here from the schemes' definitions and compared with what Spark placed.
"""

from __future__ import annotations

import sys

import pytest
from pyspark import cloudpickle

from allreduce_param import ConfigurationError
from allreduce_param.train.columns import ORDER_COLUMNS, TRAIN, VALIDATION
from allreduce_param.train.driver.data import PartitionCount, prepare
from allreduce_param.train.driver.partitioning import (
    murmur3_int,
    partition_keys,
    place_pairs,
    place_rows,
    place_rows_once,
    rows_in_place,
    xxhash64,
)
from allreduce_param.train.rows import arrays_from_arrow, join_rows, pair_chunks
from allreduce_param.train.settings import SCHEMES, check_scheme

cloudpickle.register_pickle_by_value(sys.modules[__name__])

INDEXED = ("contiguous", "round_robin", "random", "overlap_reshuffle")
TRAIN_SIZES = [4, 0, 7, 2, 1]  # rows per input partition: uneven, one empty
VALIDATION_SIZES = [2, 0, 3]
WORKERS = 4  # the session's task slots, so a barrier stage can read every placement
VALIDATION_BASE = 100


def weight_of(label):
    """A weighted row's weight, from its label: 0 for every fifth row (a weight may be 0), else
    one no other row has."""
    return 0.0 if label % 5 == 0 else label / 4 + 0.5


def frame(spark, sizes, base=0.0, weighted=False):
    """A DataFrame with exactly ``sizes[p]`` rows in input partition p; row i's label is base + i.
    ``weighted``: with a column ``w`` of ``weight_of(label)``."""
    starts = [sum(sizes[:p]) for p in range(len(sizes))]

    def rows(p):
        labels = [float(base + starts[p] + j) for j in range(sizes[p])]
        return [
            ([label, -1.0], label, weight_of(label)) if weighted else ([label, -1.0], label)
            for label in labels
        ]

    rdd = spark.sparkContext.parallelize(range(len(sizes)), len(sizes)).flatMap(rows)
    return spark.createDataFrame(
        rdd, "features array<float>, label double" + (", w double" if weighted else "")
    )


def pairs(spark, sizes):
    """An RDD of (features, label) pairs with exactly ``sizes[p]`` rows in partition p."""
    starts = [sum(sizes[:p]) for p in range(len(sizes))]
    return spark.sparkContext.parallelize(range(len(sizes)), len(sizes)).flatMap(
        lambda p: [([float(starts[p] + j)], float(starts[p] + j)) for j in range(sizes[p])]
    )


@pytest.fixture(scope="module")
def data(spark):
    prepared, summary = prepare(
        frame(spark, TRAIN_SIZES),
        "features",
        "label",
        frame(spark, VALIDATION_SIZES, VALIDATION_BASE),
    )
    return prepared, summary


def expected(scheme, workers, seed, n_train, n_validation=0):
    """Per worker, the (split, label) of its rows in order, from the schemes' definitions."""
    placed = [[] for _ in range(workers)]
    for i in range(n_train):
        if scheme == "contiguous":
            placed[i * workers // n_train].append((i, i))
        elif scheme == "round_robin":
            placed[i % workers].append((i, i))
        elif scheme == "random":
            placed[xxhash64(seed, i) % workers].append((i, i))
        else:
            for worker in range(workers):
                placed[worker].append((xxhash64(seed, worker, i), i))
    for worker in placed:
        worker.sort()
    return [
        [(TRAIN, float(i)) for _, i in worker]
        + [
            (VALIDATION, float(VALIDATION_BASE + i))
            for i in range(worker_id, n_validation, workers)
        ]
        for worker_id, worker in enumerate(placed)
    ]


def glom(df):
    """Per partition of ``df``, the (split, label) of its rows in order (by ``ORDER_COLUMNS``
    where it has them); checks features, and weights where ``df`` has them, went along."""
    keyed = all(name in df.columns for name in ORDER_COLUMNS)
    weighted = "weight" in df.columns

    def rows_of(rows):
        rows = sorted(rows, key=lambda r: (r.split, r._order, r._i)) if keyed else list(rows)
        return [(r.split, r.label, r.features[0], r.weight if weighted else None) for r in rows]

    parts = df.rdd.glom().map(rows_of).collect()
    assert all(label == first for part in parts for _, label, first, _ in part)
    assert all(
        weight == (weight_of(label) if weighted else None)
        for part in parts
        for _, label, _, weight in part
    )
    return [[(split, label) for split, label, _, _ in part] for part in parts]


def glom_pairs(rdd):
    parts = (
        rdd.glom().map(lambda rows: [(float(f[0]), float(label)) for f, label in rows]).collect()
    )
    assert all(label == first for part in parts for first, label in part)
    return [[label for _, label in part] for part in parts]


def read_in_barrier(df, weighted=False):
    """What each task of a barrier stage over ``df`` reads, per partition id, in order: as
    the fit's tasks do, through ``arrays_from_arrow``. Its weights must be ``weight_of``
    each row's label where the data is ``weighted``, else None."""

    def task(batches):
        import pyarrow as pa
        from pyspark import BarrierTaskContext

        partition = BarrierTaskContext.get().partitionId()
        X, y, split, weight = arrays_from_arrow(batches, 2)
        assert (X[:, 0] == y).all()
        weights = [None] * len(y) if weight is None else weight.tolist()
        kind = "none" if weight is None else f"{weight.dtype} {weight.shape}"
        yield pa.RecordBatch.from_pydict(
            {
                "partition": [partition] * len(y),
                "position": list(range(len(y))),
                "split": split.tolist(),
                "label": y.tolist(),
                "weight": weights,
                "kind": [kind] * len(y),
            },
            schema=pa.schema(
                [
                    ("partition", pa.int64()),
                    ("position", pa.int64()),
                    ("split", pa.int64()),
                    ("label", pa.float64()),
                    ("weight", pa.float64()),
                    ("kind", pa.string()),
                ]
            ),
        )

    out = df.mapInArrow(
        task,
        "partition long, position long, split long, label double, weight double, kind string",
        barrier=True,
    ).collect()
    parts = [[] for _ in range(df.rdd.getNumPartitions())]
    for row in sorted(out, key=lambda r: (r.partition, r.position)):
        parts[row.partition].append((row.split, row.label))
    for row in out:  # a float64 weight per row of its partition, each its own row's
        want = (
            (f"float64 ({len(parts[row.partition])},)", weight_of(row.label))
            if weighted
            else ("none", None)
        )
        assert (row.kind, row.weight) == want, row
    return parts


def read_pairs_in_barrier(rdd):
    def task(rows):
        from pyspark import BarrierTaskContext

        yield BarrierTaskContext.get().partitionId(), [float(label) for _, label in rows]

    parts = [None] * rdd.getNumPartitions()
    for partition, labels in rdd.barrier().mapPartitions(task).collect():
        parts[partition] = labels
    return parts


# ---- the scheme setting and the hashes ------------------------------------------------


def test_an_unknown_scheme_names_the_setting_and_the_choices():
    assert [check_scheme(scheme) for scheme in SCHEMES] == list(SCHEMES)
    with pytest.raises(
        ConfigurationError,
        match=r"partition_scheme='bogus'.*as_is, contiguous, round_robin, "
        r"random, overlap_reshuffle",
    ):
        check_scheme("bogus")


@pytest.mark.slow
def test_bad_workers_and_seeds_are_refused(data):
    prepared, summary = data
    with pytest.raises(
        ConfigurationError, match="num_workers must be a positive whole number, got 0"
    ):
        place_rows(prepared, 0, "random", 0, summary.partition_counts)
    with pytest.raises(ConfigurationError, match="seed must be a whole number"):
        place_pairs(None, 2, "random", 1.5)
    with pytest.raises(ConfigurationError, match="partition_counts is empty; pass the DataSummary"):
        place_rows(prepared, 2, "random", 0, ())


@pytest.mark.slow
def test_the_hashes_are_sparks_and_each_key_lands_on_its_partition(spark):
    from pyspark.sql import functions as F

    ids = (
        spark.range(-50, 50)
        .select(
            F.col("id"),
            F.hash(F.col("id").cast("int")).alias("murmur3"),
            F.xxhash64(F.lit(-7).cast("long"), F.col("id")).alias("two"),
            F.xxhash64(F.lit(3).cast("long"), F.lit(5).cast("long"), F.col("id")).alias("three"),
        )
        .collect()
    )
    assert [r.murmur3 for r in ids] == [murmur3_int(r.id) for r in ids]
    assert [r.two for r in ids] == [xxhash64(-7, r.id) for r in ids]
    assert [r.three for r in ids] == [xxhash64(3, 5, r.id) for r in ids]
    keys = partition_keys(7)
    landed = (
        spark.createDataFrame([(key,) for key in keys], "key int")
        .repartition(7, "key")
        .rdd.glom()
        .collect()
    )
    assert [[row.key for row in part] for part in landed] == [[key] for key in keys]


# ---- prepare's counts ------------------------------------------------------------------


def test_prepare_counts_the_rows_of_each_split_and_partition(data):
    _, summary = data
    train = [PartitionCount(TRAIN, p, rows, 0) for p, rows in enumerate(TRAIN_SIZES) if rows]
    validation = [
        PartitionCount(VALIDATION, len(TRAIN_SIZES) + p, rows, 0)
        for p, rows in enumerate(VALIDATION_SIZES)
        if rows
    ]
    assert summary.partition_counts == tuple(train + validation)
    assert (summary.rows(TRAIN), summary.rows(VALIDATION)) == (
        sum(TRAIN_SIZES),
        sum(VALIDATION_SIZES),
    )
    assert summary.n_features == 2 and summary.sample[1].tolist() == [0.0]
    # every partition of the union, the empty ones too, as Spark counts them
    assert (
        summary.partition_num
        == len(TRAIN_SIZES) + len(VALIDATION_SIZES)
        == data[0].rdd.getNumPartitions()
    )


# ---- the DataFrame path ----------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("scheme", INDEXED)
def test_each_scheme_gives_each_worker_exactly_its_rows_and_a_barrier_stage_reads_them(
    data, scheme
):
    prepared, summary = data
    placed = place_rows(prepared, WORKERS, scheme, 5, summary.partition_counts)
    assert placed.columns == ["features", "label", "split", *ORDER_COLUMNS]
    parts = glom(placed)
    assert parts == expected(scheme, WORKERS, 5, sum(TRAIN_SIZES), sum(VALIDATION_SIZES))
    # a second call, read by a barrier stage: the same partitions, rows and order
    again = place_rows(prepared, WORKERS, scheme, 5, summary.partition_counts)
    assert read_in_barrier(again) == parts


@pytest.mark.slow
def test_as_is_deals_each_partitions_rows_in_turn_where_it_cannot_keep_them(data):
    prepared, summary = data
    # not cached, and validation rows
    assert rows_in_place(prepared, WORKERS, "as_is", summary) is None
    parts = glom(place_rows(prepared, WORKERS, "as_is", 5, summary.partition_counts))
    assert len(parts) == WORKERS
    assert sorted(row for part in parts for row in part) == sorted(
        row
        for part in expected("round_robin", WORKERS, 0, sum(TRAIN_SIZES), sum(VALIDATION_SIZES))
        for row in part
    )
    assert all(part == sorted(part) for part in parts)  # by (split, i)
    starts = [sum(TRAIN_SIZES[:p]) for p in range(len(TRAIN_SIZES))]
    for start, size in zip(starts, TRAIN_SIZES):  # each input partition's rows spread evenly
        shares = [
            sum(start <= label < start + size for split, label in part if split == TRAIN)
            for part in parts
        ]
        assert max(shares) - min(shares) <= 1
    again = place_rows(prepared, WORKERS, "as_is", 5, summary.partition_counts)
    assert read_in_barrier(again) == parts


@pytest.mark.slow
def test_as_is_keeps_cached_partitions_one_per_worker_as_they_lie(spark):
    train = frame(spark, [3, 0, 5, 2]).cache()
    try:
        prepared, summary = prepare(train, "features", "label")
        assert summary.cached and summary.partition_num == 4
        kept = rows_in_place(prepared, 4, "as_is", summary)
        assert kept is prepared
        assert read_in_barrier(kept) == [
            [(TRAIN, 0.0), (TRAIN, 1.0), (TRAIN, 2.0)],
            [],
            [(TRAIN, float(i)) for i in range(3, 8)],
            [(TRAIN, 8.0), (TRAIN, 9.0)],
        ]
        # any other scheme, another worker count, or validation rows: the shuffle places them
        assert rows_in_place(prepared, 4, "contiguous", summary) is None
        assert rows_in_place(prepared, 3, "as_is", summary) is None
        validation = frame(spark, [1, 1, 1, 1], VALIDATION_BASE).cache()
        with_validation, both = prepare(train, "features", "label", validation)
        assert both.cached and rows_in_place(with_validation, 4, "as_is", both) is None
        validation.unpersist()
    finally:
        train.unpersist()


@pytest.fixture(scope="module")
def weighted_data(spark):
    return prepare(
        frame(spark, TRAIN_SIZES, weighted=True),
        "features",
        "label",
        frame(spark, VALIDATION_SIZES, VALIDATION_BASE, weighted=True),
        weight_col="w",
    )


@pytest.mark.slow
@pytest.mark.parametrize("scheme", SCHEMES)
def test_each_scheme_carries_each_rows_weight_along(data, weighted_data, scheme):
    """The same rows, in the same places, as unweighted; each with its own weight, copies too
    (``read_in_barrier`` and ``glom`` check every row's weight against its label)."""
    prepared, summary = weighted_data
    assert summary.weighted and prepared.columns == ["features", "label", "split", "weight"]
    placed = place_rows(prepared, WORKERS, scheme, 5, summary.partition_counts, weighted=True)
    assert placed.columns == ["features", "label", "split", "weight", *ORDER_COLUMNS]
    if scheme == "as_is":  # each input partition's rows dealt out, as for the same rows unweighted
        unweighted, unweighted_summary = data
        want = glom(place_rows(unweighted, WORKERS, scheme, 5, unweighted_summary.partition_counts))
    else:
        want = expected(scheme, WORKERS, 5, sum(TRAIN_SIZES), sum(VALIDATION_SIZES))
    assert read_in_barrier(placed, weighted=True) == want
    # place_rows_once learns from the summary that the rows have weights
    assert glom(place_rows_once(prepared, WORKERS, scheme, 5, summary)) == want


@pytest.mark.slow
def test_cached_weighted_partitions_kept_as_they_lie_keep_their_weights(spark):
    train = frame(spark, [3, 0, 5, 2], weighted=True).cache()
    try:
        prepared, summary = prepare(train, "features", "label", weight_col="w")
        kept = rows_in_place(prepared, 4, "as_is", summary)
        assert kept is prepared and summary.weighted
        assert read_in_barrier(kept, weighted=True) == [
            [(TRAIN, 0.0), (TRAIN, 1.0), (TRAIN, 2.0)],
            [],
            [(TRAIN, float(i)) for i in range(3, 8)],
            [(TRAIN, 8.0), (TRAIN, 9.0)],
        ]
    finally:
        train.unpersist()


@pytest.mark.slow
def test_the_placement_of_cached_data_is_planned_once_per_setting(spark, data):
    train, validation = (
        frame(spark, [3, 0, 5, 2]).cache(),
        frame(spark, [2, 2], VALIDATION_BASE).cache(),
    )
    try:
        prepared, summary = prepare(train, "features", "label", validation)
        first = place_rows_once(prepared, 4, "random", 7, summary)
        assert place_rows_once(prepared, 4, "random", 7, summary) is first
        others = [
            place_rows_once(prepared, 3, "random", 7, summary),
            place_rows_once(prepared, 4, "random", 8, summary),
            place_rows_once(prepared, 4, "contiguous", 7, summary),
        ]
        assert (
            all(other is not first for other in others)
            and len({id(other) for other in others}) == 3
        )
        # the kept plan places the rows as a new one does
        assert glom(first) == glom(place_rows(prepared, 4, "random", 7, summary.partition_counts))
        # data not cached may change between fits: planned anew, from its own counts
        uncached, uncached_summary = data
        assert place_rows_once(uncached, 4, "random", 7, uncached_summary) is not place_rows_once(
            uncached, 4, "random", 7, uncached_summary
        )
    finally:
        train.unpersist()
        validation.unpersist()


@pytest.mark.parametrize("weighted", [False, True])
def test_a_shuffled_partition_is_put_in_order_by_its_keys(weighted):
    import numpy as np
    import pyarrow as pa

    # rows of two splits arriving in no order, in two batches; the keys give (split, _order, _i)
    rows = [(1, 5, 0), (0, 9, 2), (0, 9, 1), (0, 3, 7), (1, 2, 3)]
    fields = [("features", pa.list_(pa.float32())), ("label", pa.float64()), ("split", pa.int32())]
    fields += [("weight", pa.float64())] if weighted else []
    batches = [
        pa.RecordBatch.from_pydict(
            {
                "features": [[float(k), float(k)] for k, _ in enumerate(part, start)],
                "label": [float(k) for k, _ in enumerate(part, start)],
                "split": [split for split, _, _ in part],
                **(
                    {"weight": [weight_of(k) for k, _ in enumerate(part, start)]}
                    if weighted
                    else {}
                ),
                "_order": [order for _, order, _ in part],
                "_i": [i for _, _, i in part],
            },
            schema=pa.schema(fields + [("_order", pa.int64()), ("_i", pa.int64())]),
        )
        for start, part in ((0, rows[:3]), (3, rows[3:]))
    ]
    X, y, split, weight = arrays_from_arrow(batches, 2)
    assert y.tolist() == [3.0, 2.0, 1.0, 4.0, 0.0]  # (0,3,7) (0,9,1) (0,9,2) (1,2,3) (1,5,0)
    assert split.tolist() == [0, 0, 0, 1, 1]
    assert X.dtype == np.float32 and X.flags.c_contiguous and (X[:, 0] == y).all()
    if weighted:  # sorted as the rows are
        assert weight.dtype == np.float64 and weight.tolist() == [weight_of(label) for label in y]
    else:
        assert weight is None
    # as they came, without the keys (the data's own partitions)
    X, y, split, weight = arrays_from_arrow(
        [batch.select(batch.schema.names[:-2]) for batch in batches], 2
    )
    assert y.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0] and (X[:, 0] == y).all()
    if weighted:
        assert weight.tolist() == [weight_of(label) for label in y]
    else:
        assert weight is None


def test_no_batches_or_pairs_are_unweighted_and_empty():
    X, y, split, weight = arrays_from_arrow(iter([]), 3)
    assert (X.shape, y.shape, split.shape, weight) == ((0, 3), (0,), (0,), None)
    pairs = iter([([1.0, 2.0], 1.0), ([3.0, 4.0], 0.0)])
    X, y, split, weight = join_rows(pair_chunks(pairs, 2), 2)
    assert X.tolist() == [[1.0, 2.0], [3.0, 4.0]] and y.tolist() == [1.0, 0.0]
    assert split.tolist() == [0, 0] and weight is None
    assert join_rows(pair_chunks(iter([]), 2), 2)[3] is None


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["random", "overlap_reshuffle"])
def test_another_seed_gives_another_placement(data, scheme):
    prepared, summary = data
    parts = glom(place_rows(prepared, WORKERS, scheme, 6, summary.partition_counts))
    assert parts == expected(scheme, WORKERS, 6, sum(TRAIN_SIZES), sum(VALIDATION_SIZES))
    assert parts != expected(scheme, WORKERS, 5, sum(TRAIN_SIZES), sum(VALIDATION_SIZES))


@pytest.mark.slow
def test_more_workers_than_rows_leave_partitions_empty(spark):
    prepared, summary = prepare(
        frame(spark, [0, 2, 0, 1]), "features", "label", frame(spark, [1], VALIDATION_BASE)
    )
    for scheme in SCHEMES:
        parts = glom(place_rows(prepared, 7, scheme, 1, summary.partition_counts))
        assert len(parts) == 7, scheme
        if scheme != "as_is":
            assert parts == expected(scheme, 7, 1, 3, 1), scheme
        if scheme != "overlap_reshuffle":  # which copies the 3 training rows to every worker
            assert sum(not part for part in parts) >= 3, scheme


@pytest.mark.slow
def test_a_barrier_stage_reads_empty_partitions(spark):
    prepared, summary = prepare(frame(spark, [2, 1]), "features", "label")
    placed = place_rows(prepared, WORKERS, "contiguous", 0, summary.partition_counts)
    assert (
        read_in_barrier(placed)
        == expected("contiguous", WORKERS, 0, 3)
        == [[(0, 0.0)], [(0, 1.0)], [(0, 2.0)], []]
    )


@pytest.mark.slow
def test_partitions_holding_both_splits_keep_each_splits_order(spark):
    # Spark's union keeps its inputs' partitioning when they share it: then one partition
    # holds training rows, then validation rows. The input's order is what Spark reads.
    train = frame(spark, [6, 5]).repartition(3, "label")
    validation = frame(spark, [4], VALIDATION_BASE).repartition(3, "label")
    prepared, summary = prepare(train, "features", "label", validation)
    assert prepared.rdd.getNumPartitions() == 3 and any(
        count.start > 0 for count in summary.partition_counts
    )
    order = {TRAIN: [], VALIDATION: []}
    for part in glom(prepared):
        for split, label in part:
            order[split].append(label)
    for scheme in ("contiguous", "random"):
        parts = glom(place_rows(prepared, 3, scheme, 2, summary.partition_counts))
        want = [
            [(split, order[split][int(label) % VALIDATION_BASE]) for split, label in part]
            for part in expected(scheme, 3, 2, 11, 4)
        ]
        assert parts == want, scheme


@pytest.mark.slow
def test_a_local_relation_is_indexed_in_its_own_order(spark):
    values = spark.sql(
        "SELECT array(CAST(id AS FLOAT)) AS features, CAST(id AS DOUBLE) AS label "
        "FROM VALUES (0), (1), (2), (3), (4) AS t(id)"
    )
    prepared, summary = prepare(values, "features", "label")
    assert glom(place_rows(prepared, 2, "contiguous", 0, summary.partition_counts)) == expected(
        "contiguous", 2, 0, 5
    )


@pytest.mark.slow
def test_rows_that_do_not_match_the_counts_fail_the_shuffle(spark, data):
    prepared, _ = data
    _, other = prepare(frame(spark, [3]), "features", "label")
    with pytest.raises(Exception, match="not among the rows prepare\\(\\) counted"):
        place_rows(prepared, 2, "round_robin", 0, other.partition_counts).collect()


# ---- the RDD path ----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("scheme", INDEXED)
def test_each_scheme_places_pairs_exactly_and_a_barrier_stage_reads_them(spark, scheme):
    parts = glom_pairs(place_pairs(pairs(spark, TRAIN_SIZES), WORKERS, scheme, 5))
    assert parts == [
        [label for _, label in part] for part in expected(scheme, WORKERS, 5, sum(TRAIN_SIZES))
    ]
    assert (
        read_pairs_in_barrier(place_pairs(pairs(spark, TRAIN_SIZES), WORKERS, scheme, 5)) == parts
    )


@pytest.mark.slow
def test_pairs_as_is_are_rdd_repartition_in_index_order(spark):
    parts = glom_pairs(place_pairs(pairs(spark, TRAIN_SIZES), 3, "as_is", 5))
    spark_placed = glom_pairs(pairs(spark, TRAIN_SIZES).repartition(3))
    assert parts == [sorted(part) for part in spark_placed]
    assert read_pairs_in_barrier(place_pairs(pairs(spark, TRAIN_SIZES), 3, "as_is", 5)) == parts


@pytest.mark.parametrize("scheme", ["random", "overlap_reshuffle"])
def test_pairs_follow_the_seed(spark, scheme):
    parts = glom_pairs(place_pairs(pairs(spark, TRAIN_SIZES), WORKERS, scheme, 6))
    assert parts == [
        [label for _, label in part] for part in expected(scheme, WORKERS, 6, sum(TRAIN_SIZES))
    ]
    assert parts != [
        [label for _, label in part] for part in expected(scheme, WORKERS, 5, sum(TRAIN_SIZES))
    ]


@pytest.mark.slow
def test_more_workers_than_pairs_leave_partitions_empty(spark):
    for scheme in SCHEMES:
        parts = glom_pairs(place_pairs(pairs(spark, [0, 2, 1]), 7, scheme, 1))
        assert len(parts) == 7, scheme
        if scheme != "as_is":
            assert parts == [[label for _, label in part] for part in expected(scheme, 7, 1, 3)], (
                scheme
            )
