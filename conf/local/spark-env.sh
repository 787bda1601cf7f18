# Sourced by spark-submit when SPARK_CONF_DIR=conf/local: keep all traffic on loopback.
# This machine only; on a cluster see conf/cluster/.
export SPARK_LOCAL_IP="${SPARK_LOCAL_IP:-127.0.0.1}"
