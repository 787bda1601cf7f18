"""What the engine needs from Spark, and the only code on its side that imports pyspark:
settings read from the session, Spark info (classic and Connect), task slots, the barrier
rendezvous, local sessions, and the JVM's class archive."""
