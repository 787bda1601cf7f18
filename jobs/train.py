"""The main job: train a model described by a job file.

    python jobs/train.py --conf conf/digits.toml
    SPARK_CONF_DIR=conf spark-submit jobs/train.py --conf conf/digits.toml

The same as the ``allreduce-param train`` command.
"""

import sys

from allreduce_param.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
