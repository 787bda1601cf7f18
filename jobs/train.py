"""The main job: train a model described by a job file.

On this machine (the job file's ``[spark] conf_dir``, conf/local, holds the Spark settings):

    python jobs/train.py --conf conf/digits.toml
    SPARK_CONF_DIR=conf/local spark-submit jobs/train.py --conf conf/digits.toml

On a cluster, with a cluster's settings instead (the README's "Running on a cluster"):

    PYSPARK_PYTHON=$PWD/.venv/bin/python .venv/bin/spark-submit --master spark://HOST:7077 \
        --properties-file conf/cluster/standalone.conf jobs/train.py --conf conf/digits.toml

Under spark-submit the job file's ``master`` and ``conf_dir`` are not applied: spark-submit's
own settings are. The same as the ``allreduce-param train`` command.
"""

import sys

from allreduce_param.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
