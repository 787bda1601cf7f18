"""The split column of the rows the driver hands a fit's tasks: which rows train, which
validate. The driver writes it (``driver.data.prepare``), each task reads it."""

#: A training row's and a validation row's value in the ``split`` column.
TRAIN, VALIDATION = 0, 1
