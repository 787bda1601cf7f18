"""The main job as a user runs it: jobs/train.py's ``main`` with a job file from conf/, and
the folder of Spark settings a job file names."""

from __future__ import annotations

from pathlib import Path

import pytest

from allreduce_param import ConfigurationError, TrainedModel, optim
from allreduce_param.cli import apply_overrides, build, load_job, main, spark_conf_dir

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.spark
def test_the_main_job_trains_prints_its_table_and_writes_the_model(tmp_path, capsys):
    """jobs/train.py's ``main`` (the script is that one line), in this process: its session
    starts in the driver JVM this process's sessions share, instead of a JVM of its own
    (the README's recipe runs the script itself under spark-submit: test_standalone_cluster)."""
    status = main(
        [
            "train",
            "--conf",
            str(REPO / "conf" / "digits.toml"),
            "--master",
            "local[2]",
            "--set",
            "train.epochs=3",
            "--set",
            f"output.model_path='{tmp_path / 'm'}'",
            "--set",
            f"output.loss_curve='{tmp_path / 'new folder' / 'loss.png'}'",
        ]  # folders made as needed
    )
    out, err = capsys.readouterr()
    assert status == 0, err[-3000:]
    assert "| test accuracy  |" in out and "| samples/s      |" in out
    assert "epoch 2: val_loss" in out + err  # the live progress, a line per epoch
    assert (tmp_path / "new folder" / "loss.png").stat().st_size > 5000
    model = TrainedModel.load(tmp_path / "m")
    assert len(model.history.epochs) == 3 and model.history.epochs[-1]["val_accuracy"] > 0.8


def test_job_file_errors_name_the_setting(tmp_path):
    with pytest.raises(ConfigurationError, match="no job file at"):
        load_job(tmp_path / "missing.toml")
    (tmp_path / "bad.toml").write_text("[train\n")
    with pytest.raises(ConfigurationError, match="is not valid TOML"):
        load_job(tmp_path / "bad.toml")
    with pytest.raises(
        ConfigurationError,
        match=r"\[optimizer\] kind = 'Adamm' is not one of \['Optimizer', .*'Adam'",
    ):
        build(optim, {"kind": "Adamm"}, "optimizer")
    with pytest.raises(
        ConfigurationError,
        match=r"\[optimizer\] Adam: .*unexpected keyword argument 'learning_rate'",
    ):
        build(optim, {"kind": "Adam", "learning_rate": 0.1}, "optimizer")
    with pytest.raises(ConfigurationError, match="write SECTION.KEY=VALUE"):
        apply_overrides({}, ["epochs=5"])
    assert apply_overrides(
        {"train": {"epochs": 40}}, ["train.epochs=5", "spark.master=local[2]"]
    ) == {"train": {"epochs": 5}, "spark": {"master": "local[2]"}}


def test_a_job_file_names_its_spark_settings_folder(tmp_path, monkeypatch):
    digits = REPO / "conf" / "digits.toml"
    # relative to the job file
    assert spark_conf_dir(load_job(digits), digits) == REPO / "conf" / "local"
    monkeypatch.chdir(REPO)
    assert spark_conf_dir(load_job(digits), "conf/digits.toml") == REPO / "conf" / "local"
    # none named: Spark's defaults
    assert spark_conf_dir({"spark": {"master": "local[2]"}}, digits) is None
    monkeypatch.setenv("PYSPARK_GATEWAY_PORT", "1")  # under spark-submit its own settings apply
    assert spark_conf_dir(load_job(digits), digits) is None
    monkeypatch.delenv("PYSPARK_GATEWAY_PORT")
    (tmp_path / "empty").mkdir()
    with pytest.raises(
        ConfigurationError,
        match=r"\[spark\] conf_dir = 'empty' in .*job.toml: .*empty has no "
        r"spark-defaults.conf; name a folder that has one",
    ):
        spark_conf_dir({"spark": {"conf_dir": "empty"}}, tmp_path / "job.toml")
    with pytest.raises(
        ConfigurationError, match=r"\[spark\] conf_dir = 1 in .*: write a folder's path as text"
    ):
        spark_conf_dir({"spark": {"conf_dir": 1}}, tmp_path / "job.toml")


def test_the_main_job_with_a_cluster_master_says_to_use_spark_submit(capsys):
    # started with python, a local session would pin the driver to 127.0.0.1: refused before Spark starts
    status = main(
        ["train", "--conf", str(REPO / "conf" / "digits.toml"), "--master", "spark://10.0.3.2:7077"]
    )
    error = capsys.readouterr().err
    assert (
        status == 2
        and "spark-submit --master spark://10.0.3.2:7077 --properties-file "
        "conf/cluster/standalone.conf"
        in error
        and "Traceback" not in error
    )


def test_a_job_files_engine_settings_are_checked_before_spark_starts(monkeypatch, capsys):
    from allreduce_param import FitSettings, cli

    # a bare word is text
    job = apply_overrides({"train": {}}, ["train.topology=flat", "train.fetch_threads=4"])
    assert (FitSettings.of(job["train"]).topology, FitSettings.of(job["train"]).fetch_threads) == (
        "flat",
        4,
    )

    def no_spark(*args, **kwargs):
        raise AssertionError("Spark started for a job whose settings are bad")

    monkeypatch.setattr(cli, "local_spark", no_spark)
    status = main(
        [
            "train",
            "--conf",
            str(REPO / "conf" / "digits.toml"),
            "--set",
            "train.topology=hierarchical",
            "--set",
            "train.strategy=ssp",
            "--set",
            "train.staleness=2",
        ]
    )
    error = capsys.readouterr().err
    assert status == 2 and "Traceback" not in error
    assert error.startswith(
        "error: topology='hierarchical' goes with strategy='bsp' and no backup workers, "
        "not with strategy='ssp'"
    )
    assert (
        main(
            [
                "train",
                "--conf",
                str(REPO / "conf" / "digits.toml"),
                "--set",
                "train.fetch_threads=0",
            ]
        )
        == 2
    )
    assert "fetch_threads must be a positive whole number, got 0" in capsys.readouterr().err
