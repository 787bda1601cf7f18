# Sourced by spark-submit when SPARK_CONF_DIR points here: keep all traffic on loopback.
export SPARK_LOCAL_IP="${SPARK_LOCAL_IP:-127.0.0.1}"
