"""One error model: every error is ours, none is an OSError, each server answer has its type."""

from __future__ import annotations

import numpy as np
import pytest

import allreduce_param.errors
from allreduce_param import (
    AllReduceError,
    FetchTimeoutError,
    FitSettings,
    PeerLostError,
    TrainingError,
    models,
    optim,
)
from allreduce_param.engine import (
    AllReduceParameter,
    AuthenticationError,
    LocalRendezvous,
    StaleVersionError,
)
from allreduce_param.engine.blocks.store import BlockKey, BlockKind, BlockStore
from allreduce_param.engine.wire.blocks import BlockServer, PeerClient
from allreduce_param.train.task.job import TrainingJob
from allreduce_param.train.task.worker import train_partition

SECRET = b"s" * 32
KEY = BlockKey(BlockKind.WEIGHT, 0, 0xFFFFFFFF)


def test_every_error_is_ours_and_none_is_an_oserror():
    errors = [
        value
        for value in vars(allreduce_param.errors).values()
        if isinstance(value, type) and issubclass(value, BaseException)
    ]
    assert len(errors) >= 16
    for error in errors:
        assert issubclass(error, AllReduceError), error
        # code catching socket errors never catches ours
        assert not issubclass(error, OSError), error


def test_each_answer_of_a_block_server_has_its_own_error_type():
    store = BlockStore(keep=1)
    server = BlockServer(
        store, SECRET, param_id=5, partition_id=0, host="127.0.0.1", partition_num=2
    )
    client = PeerClient(server.address, SECRET, 5, 1, peer_partition=0, timeout=0.2)
    try:
        store.put(KEY, 0, b"zero")
        store.put(KEY, 1, b"one")
        raised = []
        for version, expected in ((0, StaleVersionError), (7, FetchTimeoutError)):
            with pytest.raises(expected) as failure:
                client.fetch(KEY, version, 100, None)
            raised.append(type(failure.value))
        assert client.fetch(KEY, 1, 100, None)[0] == 1  # a clean answer left the connection usable
        stranger = PeerClient(server.address, b"x" * 32, 5, 1, peer_partition=0, timeout=5)
        with pytest.raises(AuthenticationError) as failure:
            stranger.fetch(KEY, 1, 100, None)
        raised.append(type(failure.value))
        stranger.close()
        store.close("partition 0 failed: ValueError: boom")
        with pytest.raises(
            PeerLostError,
            match="shut down while we fetched .*; it said: partition 0 failed: ValueError: boom",
        ) as failure:
            client.fetch(KEY, 1, 100, None)
        raised.append(type(failure.value))
        assert len(set(raised)) == 4
    finally:
        client.close()
        server.close()


def test_a_task_that_cannot_meet_its_peers_names_its_partition():
    model = models.SoftmaxRegression(3, 2)
    param = AllReduceParameter(2, model.size, codec="raw")
    job = TrainingJob(
        model, optim.SGD(lr=0.1), param, FitSettings(batch_size=4, epochs=1, seed=0), 3, False
    )
    group = LocalRendezvous(3)  # three tasks for a parameter of two
    with pytest.raises(
        TrainingError,
        match=r"^partition 1, meeting its peers: ConfigurationError: .* was made for 2 "
        r"partitions but this stage has 3 tasks",
    ):
        list(
            train_partition(
                job,
                np.zeros((2, 3), np.float32),
                np.zeros(2),
                np.zeros(2, np.int32),
                rendezvous=group.member(1),
            )
        )
