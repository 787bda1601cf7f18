"""The Spark-free engine: ``AllReduceParameter`` (the driver's spec) and the step API of a
connected partition, over the movement of blocks between peers, the wire and the block store."""
