"""Live progress of a fit: each task reports its steps to the driver (``task.reporter``),
which merges and shows them (``driver.progress``); both ends, by their old names here."""

from allreduce_param.train.driver.progress import ProgressBar, ProgressMerger
from allreduce_param.train.task.reporter import ProgressReporter

__all__ = ["ProgressBar", "ProgressMerger", "ProgressReporter"]
