"""The generated problems of ``bench_sparse.py``: hashed text and a hashed click log, each
row regenerated from the seed in the executors (see that module's docstring for what they are).

Each block of ``BLOCK_ROWS`` row ids has a generator of its own, so the rows are the same
whatever the master or the partitioning. ``bench_sparse`` sends this module's code to the
executors by value (they cannot import jobs/).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: rows per generator block: row i's values come from the generator of block i // BLOCK_ROWS
BLOCK_ROWS = 10_000
#: rows on which the Bayes accuracy is computed
BAYES_ROWS = 20_000


def mix(values: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, vectorised: uint64 -> well-mixed uint64."""
    with np.errstate(over="ignore"):
        z = values.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def _uniform(values: np.ndarray) -> np.ndarray:
    """uint64 hashes -> floats in (0, 1)."""
    return ((values >> np.uint64(11)).astype(np.float64) + 0.5) / float(2**53)


@dataclass(frozen=True)
class TextData:
    """Documents with class-dependent word frequencies (see the module's docstring)."""

    rows: int
    classes: int = 2
    vocabulary: int = 20_000
    tilted: int = 2_000
    tilt: float = 2.5
    doc_words: int = 40
    test_fraction: float = 0.2
    seed: int = 0

    def word_probabilities(self) -> np.ndarray:
        """(classes, vocabulary) word probabilities: a Zipf law, each class's words tilted."""
        base = 1.0 / np.arange(1, self.vocabulary + 1) ** 1.07
        rng = np.random.default_rng([self.seed, 0])
        low, high = min(100, self.vocabulary // 10), max(self.vocabulary // 2, 1)
        probabilities = np.tile(base, (self.classes, 1))
        for k in range(self.classes):
            chosen = rng.choice(
                np.arange(low, high), size=min(self.tilted, high - low), replace=False
            )
            probabilities[k, chosen] *= self.tilt
        return probabilities / probabilities.sum(axis=1, keepdims=True)

    def block(self, index: int, probabilities: np.ndarray):
        """Rows ``index * BLOCK_ROWS`` onwards: (word ids per document, labels, is_test)."""
        count = min(BLOCK_ROWS, self.rows - index * BLOCK_ROWS)
        rng = np.random.default_rng([self.seed, 1, index])
        labels = rng.integers(0, self.classes, count)
        lengths = 8 + rng.poisson(max(self.doc_words - 8, 0), count)
        is_test = rng.random(count) < self.test_fraction
        words = np.empty(int(lengths.sum()), np.int64)
        owner = np.repeat(np.arange(count), lengths)
        for k in range(self.classes):
            at = labels[owner] == k
            cumulative = np.cumsum(probabilities[k])
            words[at] = np.minimum(
                np.searchsorted(cumulative, rng.random(int(at.sum()))), self.vocabulary - 1
            )
        documents = np.split(words, np.cumsum(lengths)[:-1])
        return documents, labels, is_test

    def columns(self, index: int, probabilities: np.ndarray) -> dict:
        documents, labels, is_test = self.block(index, probabilities)
        return {
            "text": [" ".join(f"w{w}" for w in doc) for doc in documents],
            "label": labels.astype(np.float64),
            "is_test": is_test,
        }

    def schema(self) -> str:
        return "text string, label double, is_test boolean"

    def shared(self):
        return self.word_probabilities()

    def bayes_accuracy(self) -> float:
        """Naive Bayes over the word counts (exact for this generator) on the first rows."""
        probabilities = self.word_probabilities()
        logs = np.log(probabilities)
        right = total = 0
        for index in range(max(1, min(BAYES_ROWS, self.rows) // BLOCK_ROWS)):
            documents, labels, _ = self.block(index, probabilities)
            scores = np.stack([logs[:, doc].sum(axis=1) for doc in documents])
            right += int(np.sum(scores.argmax(axis=1) == labels))
            total += len(labels)
        return right / total

    def describe(self) -> str:
        return (
            f"{self.rows:,} documents, {self.classes} classes, Zipf vocabulary of {self.vocabulary:,} "
            f"words, {self.tilted:,} words a class x{self.tilt:g}, ~{self.doc_words} words a document"
        )


@dataclass(frozen=True)
class ClickData:
    """A click log: categorical fields with power-law values, a hidden logistic label."""

    rows: int
    fields: int = 26
    informative: int = 13
    max_levels: int = 1_000_000
    weight_scale: float = 0.6
    test_fraction: float = 0.2
    seed: int = 0

    def levels(self) -> np.ndarray:
        return np.round(np.logspace(1, np.log10(self.max_levels), self.fields)).astype(np.int64)

    def values(self, index: int) -> tuple[np.ndarray, np.random.Generator]:
        """Rows of block ``index``: (values, rows x fields, int64; the block's generator)."""
        count = min(BLOCK_ROWS, self.rows - index * BLOCK_ROWS)
        rng = np.random.default_rng([self.seed, 2, index])
        draws = rng.zipf(1.2, size=(count, self.fields)) - 1
        levels = self.levels()
        # a different order of the levels in each field: the popular values are not 0, 1, ...
        return (draws % levels + mix(np.arange(self.fields) + self.seed) % levels) % levels, rng

    def logits(self, values: np.ndarray) -> np.ndarray:
        """The hidden model's logit of each row: a normal weight per (field, value)."""
        fields = np.arange(self.informative, dtype=np.uint64)
        keys = (
            values[:, : self.informative].astype(np.uint64) * np.uint64(1_000_003)
            + fields * np.uint64(7_919)
            + np.uint64(self.seed) * np.uint64(104_729)
        )
        u1, u2 = _uniform(mix(keys)), _uniform(mix(keys ^ np.uint64(0x5555)))
        normal = np.sqrt(-2 * np.log(u1)) * np.cos(2 * np.pi * u2)
        return self.weight_scale * normal.sum(axis=1)

    def block(self, index: int):
        values, rng = self.values(index)
        p = 1 / (1 + np.exp(-self.logits(values)))
        labels = (rng.random(len(values)) < p).astype(np.float64)
        is_test = rng.random(len(values)) < self.test_fraction
        return values, labels, is_test, p

    def columns(self, index: int, shared) -> dict:
        values, labels, is_test, _ = self.block(index)
        out = {f"f{f}": values[:, f].astype(np.int32) for f in range(self.fields)}
        out.update(label=labels, is_test=is_test)
        return out

    def schema(self) -> str:
        return (
            ", ".join(f"f{f} int" for f in range(self.fields)) + ", label double, is_test boolean"
        )

    def shared(self):
        return None

    def bayes_accuracy(self) -> float:
        ps = [
            self.block(index)[3]
            for index in range(max(1, min(BAYES_ROWS, self.rows) // BLOCK_ROWS))
        ]
        p = np.concatenate(ps)
        return float(np.mean(np.maximum(p, 1 - p)))

    def describe(self) -> str:
        return (
            f"{self.rows:,} rows, {self.fields} categorical fields of 10 to {self.max_levels:,} levels "
            f"(Zipf 1.2), label from a hidden logistic model over {self.informative} fields"
        )


def generated_rows(spark, data):
    """The problem's raw columns (``data.schema()``), generated in the executors, as many
    partitions as Spark's default parallelism; not cached."""
    import pyarrow as pa

    shared = data.shared()

    def generate(batches):
        for batch in batches:
            ids = batch.column(0).to_numpy()
            for index in np.unique(ids // BLOCK_ROWS):
                columns = data.columns(int(index), shared)
                offsets = ids[ids // BLOCK_ROWS == index] - index * BLOCK_ROWS
                picked = {
                    name: [values[i] for i in offsets]
                    if isinstance(values, list)
                    else np.asarray(values)[offsets]
                    for name, values in columns.items()
                }
                yield pa.RecordBatch.from_pydict(picked)

    partitions = spark.sparkContext.defaultParallelism
    return spark.range(0, data.rows, numPartitions=partitions).mapInArrow(generate, data.schema())


def hashed_frame(spark, data, features: int):
    """``features vector, label double, is_test boolean``: the problem hashed into
    ``features`` columns by Spark's transformers (HashingTF or FeatureHasher)."""
    from pyspark.ml.feature import FeatureHasher, HashingTF, Tokenizer

    raw = generated_rows(spark, data)
    if isinstance(data, TextData):
        words = Tokenizer(inputCol="text", outputCol="words").transform(raw)
        hashed = HashingTF(inputCol="words", outputCol="features", numFeatures=features).transform(
            words
        )
    else:
        names = [f"f{f}" for f in range(data.fields)]
        hashed = FeatureHasher(
            inputCols=names, categoricalCols=names, outputCol="features", numFeatures=features
        ).transform(raw)
    return hashed.select("features", "label", "is_test")


def csr_sizes(frame) -> list[tuple[int, int]]:
    """(rows, stored non-zeros) of each partition of ``frame``'s ``features`` column, read
    the way a fit reads it (``VectorParts`` from Arrow)."""
    import pyarrow as pa

    def count(batches):
        from allreduce_param.train.features import VectorParts

        rows = nonzeros = 0
        for batch in batches:
            parts = VectorParts.from_arrow(batch.column(0))
            rows += parts.rows
            nonzeros += int(parts.nonzeros().sum())
        yield pa.RecordBatch.from_pydict({"rows": [rows], "nonzeros": [nonzeros]})

    got = frame.select("features").mapInArrow(count, "rows long, nonzeros long").collect()
    return [(row["rows"], row["nonzeros"]) for row in got]
