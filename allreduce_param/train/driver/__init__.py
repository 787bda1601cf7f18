"""The fit's driver side: ``DistriOptimizer.fit``, data checks, placement of rows, and the
merging of what the tasks report."""
