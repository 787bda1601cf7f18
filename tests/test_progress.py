"""The driver's progress server: merged steps, and frames it must refuse."""

from __future__ import annotations

import logging
import socket
import threading

from allreduce_param.train.progress import MAX_FRAME, ProgressReporter, ProgressServer
from allreduce_param.train.result import STEP_FIELDS, merge_step


class Events:
    def __init__(self, expected: int):
        self.items, self._expected, self.done = [], expected, threading.Event()

    def __call__(self, kind, fields):
        self.items.append((kind, fields))
        if len(self.items) >= self._expected:
            self.done.set()


def record(epoch, step, loss_sum, samples, seconds):
    return [epoch, step, loss_sum, samples] + [seconds] * (len(STEP_FIELDS) - 4)


def test_a_step_is_merged_once_every_partition_reported_it():
    events = Events(expected=2)
    server = ProgressServer("127.0.0.1", 2, merge_step, events)
    reporters = [server.reporter() for _ in range(2)]
    try:
        reporters[0].send("start", partition=0, steps=1, epochs=1)
        reporters[0].send("step", record=record(0, 0, 6.0, 2, 0.1))
        reporters[1].send("step", record=record(0, 0, 4.0, 3, 0.3))
        assert events.done.wait(30)
    finally:
        for reporter in reporters:
            reporter.close()
        server.close()
    assert events.items[0] == ("start", {"partition": 0, "steps": 1, "epochs": 1})
    kind, merged = events.items[1]
    assert kind == "step" and merged["samples"] == 5 and merged["loss"] == 2.0
    assert merged["get_s"] == 0.3  # the slowest partition's phase


def test_frames_without_the_secret_or_too_long_are_refused(caplog):
    events = Events(expected=1)
    server = ProgressServer("127.0.0.1", 1, merge_step, events)
    try:
        with caplog.at_level(logging.WARNING, logger="allreduce_param.train.progress"):
            ProgressReporter(server.address, b"x" * 32).send("start", partition=0, steps=1, epochs=1)
            with socket.create_connection(server.address) as sock:
                sock.sendall((MAX_FRAME + 1).to_bytes(4, "little"))
                sock.settimeout(30)
                assert sock.recv(1) == b""  # closed by the server
            good = server.reporter()
            good.send("epoch", epoch=0, val_loss=0.5)
            assert events.done.wait(30)
            good.close()
    finally:
        server.close()
    assert events.items == [("epoch", {"epoch": 0, "val_loss": 0.5})]
    assert "a frame without the fit's secret" in caplog.text
    assert f"a frame of {MAX_FRAME + 1} bytes" in caplog.text


def test_a_reporter_whose_driver_is_gone_keeps_quiet():
    server = ProgressServer("127.0.0.1", 1, merge_step, lambda kind, fields: None)
    reporter = server.reporter()
    server.close()
    for _ in range(3):  # no exception: training goes on without progress
        reporter.send("step", record=record(0, 0, 1.0, 1, 0.1))
    assert reporter._broken


def test_a_resumed_attempt_drops_what_the_failed_one_left_half_reported():
    events = Events(expected=2)
    started = Events(expected=1)
    server = ProgressServer("127.0.0.1", 2, merge_step,
                            lambda kind, fields: (events(kind, fields), kind == "start" and started(kind, fields)))
    reporters = [server.reporter() for _ in range(2)]
    try:
        # the failed attempt: only partition 0 reported step 3
        reporters[0].send("step", partition=0, record=record(0, 3, 9.0, 2, 0.1))
        reporters[0].send("start", partition=0, steps=4, epochs=1, resumed=[0, 3], done=3)
        assert started.done.wait(30)
        reporters[1].send("step", partition=1, record=record(0, 3, 4.0, 2, 0.3))  # the new attempt's
        reporters[0].send("step", partition=0, record=record(0, 3, 2.0, 2, 0.2))
        assert events.done.wait(30)
    finally:
        for reporter in reporters:
            reporter.close()
        server.close()
    kind, merged = events.items[-1]
    assert kind == "step" and merged["loss"] == 1.5  # (4 + 2) / 4: the new attempt's two records
