"""The driver's end of the tasks' connections: authenticated messages, progress merged per
step, and the meeting point where the partitions learn each other's addresses."""

from __future__ import annotations

import io
import logging
import socket
import threading
import time

import pytest

from allreduce_param.engine.movement.rendezvous import MeetingPoint, by_partition
from allreduce_param.engine.wire.messages import (
    MAX_MESSAGE,
    MessageClient,
    MessageServer,
    _frame,
    _read,
)
from allreduce_param.errors import AuthenticationError, UsageError
from allreduce_param.train.driver.progress import ProgressMerger
from allreduce_param.train.result import STEP_FIELDS, merge_step
from allreduce_param.train.task.reporter import ProgressReporter


class Events:
    def __init__(self, expected: int):
        self.items, self._expected, self.done = [], expected, threading.Event()

    def __call__(self, kind, fields):
        self.items.append((kind, fields))
        if len(self.items) >= self._expected:
            self.done.set()


def record(epoch, step, loss_sum, samples, seconds):
    return [epoch, step, loss_sum, samples] + [seconds] * (len(STEP_FIELDS) - 4)


def progress_server(partitions, on_event):
    return MessageServer("127.0.0.1", ProgressMerger(partitions, merge_step, on_event).on_message)


def test_a_step_is_merged_once_every_partition_reported_it():
    events = Events(expected=2)
    server = progress_server(2, events)
    reporters = [ProgressReporter(server.client()) for _ in range(2)]
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


def test_drain_hears_every_message_the_ended_tasks_sent_before_closing():
    """A fit's tasks close their connections as they end, their last steps maybe still
    unread: the driver drains before it closes, so its listener hears every step."""
    heard, gate, hellos, met = [], threading.Event(), [], threading.Event()

    def on_message(message, reply):
        if message["n"] == "hello":  # as a task meets: its connection is the server's now
            hellos.append(1)
            if len(hellos) == 3:
                met.set()
            return
        gate.wait(30)  # the handler lags behind the senders: messages wait unread
        heard.append(message["n"])

    server = MessageServer("127.0.0.1", on_message)
    clients = [server.client() for _ in range(3)]
    try:
        for client in clients:
            client.send({"n": "hello"})
        assert met.wait(30)
        *ending, lingering = clients
        for client in ending:
            for n in range(20):
                client.send({"n": n})
            client.close()
        lingering.send({"n": -1})
        gate.set()
        assert server.drain(0.5) is False  # a task still connected: drain says so, in time
        lingering.close()
        assert server.drain(30) is True
        assert sorted(heard) == sorted([-1] + list(range(20)) * 2)
    finally:
        gate.set()
        server.close()


def test_a_client_without_the_secret_is_refused_in_the_handshake_and_others_go_on(caplog):
    events = Events(expected=1)
    server = progress_server(1, events)
    try:
        with caplog.at_level(logging.WARNING, logger="allreduce_param.engine.wire.server"):
            stranger = MessageClient(server.address, b"x" * 32)
            with pytest.raises(
                AuthenticationError, match="refused this connection: it does not know this job's"
            ):
                stranger.send({"kind": "epoch", "epoch": 9})
            stranger.close()
            quiet = ProgressReporter(MessageClient(server.address, b"x" * 32))
            # a reporter says nothing, and stops
            quiet.send("start", partition=0, steps=1, epochs=1)
            assert quiet._broken
            good = ProgressReporter(server.client())
            good.send("epoch", epoch=0, val_loss=0.5)
            assert events.done.wait(30)
            good.close()
    finally:
        server.close()
    assert events.items == [("epoch", {"epoch": 0, "val_loss": 0.5})]
    assert "the driver's message server refused connection from 127.0.0.1" in caplog.text
    assert "it could not prove the secret" in caplog.text


def test_a_too_long_message_closes_that_connection_only(caplog):
    events = Events(expected=1)
    server = progress_server(1, events)
    rogue = server.client()
    try:
        with caplog.at_level(logging.WARNING, logger="allreduce_param.engine.wire.messages"):
            sock = rogue._connected()  # proven
            sock.sendall((MAX_MESSAGE + 1).to_bytes(4, "little"))
            sock.settimeout(30)
            assert sock.recv(1) == b""  # closed by the server
        good = ProgressReporter(server.client())
        good.send("epoch", epoch=0, val_loss=0.5)
        assert events.done.wait(30)
        good.close()
    finally:
        rogue.close()
        server.close()
    assert f"a message of {MAX_MESSAGE + 1} bytes" in caplog.text


def test_a_message_sent_again_or_back_is_refused(caplog):
    """Each tag covers the connection's key, the direction and the message's number."""
    key = b"k" * 32
    frame = _frame(key, b"task", 0, {"kind": "meet"})

    def read(key, direction, number):
        sender, receiver = socket.socketpair()
        with sender, receiver:
            sender.sendall(frame)
            return _read(receiver, key, direction, number)

    assert read(key, b"task", 0) == {"kind": "meet"}
    with pytest.raises(AuthenticationError, match="message 0 from the driver has a wrong tag"):
        read(key, b"driver", 0)  # a task's own message, sent back as an answer
    with pytest.raises(AuthenticationError, match="message 1 from the task has a wrong tag"):
        read(key, b"task", 1)  # the same message again
    with pytest.raises(AuthenticationError):
        read(b"o" * 32, b"task", 0)  # another connection's
    # on a live connection: a message replayed there closes it
    events = Events(expected=1)
    server = progress_server(1, events)
    client = server.client()
    try:
        client.send({"kind": "epoch", "epoch": 0, "val_loss": 0.5})
        with caplog.at_level(logging.WARNING, logger="allreduce_param.engine.wire.messages"):
            client._sock.sendall(
                _frame(client._key, b"task", 0, {"kind": "epoch", "epoch": 0, "val_loss": 0.5})
            )
            client._sock.settimeout(30)
            assert client._sock.recv(1) == b""
        assert events.done.wait(30)
    finally:
        client.close()
        server.close()
    assert events.items == [("epoch", {"epoch": 0, "val_loss": 0.5})]  # once
    assert "message 1 from the task has a wrong tag" in caplog.text


def test_a_reporter_whose_driver_is_gone_keeps_quiet():
    server = progress_server(1, lambda kind, fields: None)
    reporter = ProgressReporter(server.client())
    server.close()
    for _ in range(3):  # no exception: training goes on without progress
        reporter.send("step", record=record(0, 0, 1.0, 1, 0.1))
    assert reporter._broken


def test_a_driver_that_stops_reading_cannot_stall_a_task():
    """Each send is bounded by the connect timeout: a stuck listener on the driver fills the
    connection's buffers, and the task's reporter then gives up instead of blocking."""
    stuck, release = threading.Event(), threading.Event()

    def on_message(message, reply):
        stuck.set()
        release.wait(60)  # the driver's handler hangs: it reads nothing more meanwhile

    server = MessageServer("127.0.0.1", on_message, connect_timeout=0.5)
    reporter = ProgressReporter(server.client())
    try:
        sent = 0
        while (
            not reporter._broken and sent < 10_000
        ):  # each 64 KiB: the buffers hold a few MiB at most
            reporter.send("step", filler="x" * (64 << 10))
            sent += 1
        assert stuck.is_set() and reporter._broken, sent
    finally:
        release.set()
        reporter.close()
        server.close()


def test_a_resumed_attempt_drops_what_the_failed_one_left_half_reported():
    events = Events(expected=2)
    started = Events(expected=1)
    server = progress_server(
        2, lambda kind, fields: (events(kind, fields), kind == "start" and started(kind, fields))
    )
    reporters = [ProgressReporter(server.client()) for _ in range(2)]
    try:
        # the failed attempt: only partition 0 reported step 3
        reporters[0].send("step", partition=0, record=record(0, 3, 9.0, 2, 0.1))
        reporters[0].send("start", partition=0, steps=4, epochs=1, resumed=[0, 3], done=3)
        assert started.done.wait(30)
        # the new attempt's
        reporters[1].send("step", partition=1, record=record(0, 3, 4.0, 2, 0.3))
        reporters[0].send("step", partition=0, record=record(0, 3, 2.0, 2, 0.2))
        assert events.done.wait(30)
    finally:
        for reporter in reporters:
            reporter.close()
        server.close()
    kind, merged = events.items[-1]
    assert kind == "step" and merged["loss"] == 1.5  # (4 + 2) / 4: the new attempt's two records


def meet(server, partitions, stage=7, tasks=None):
    """Each of ``partitions`` meets at ``server`` on a thread of its own; their answers."""
    answers = {}

    def one(partition):
        client = server.client()
        try:
            client.send(
                {
                    "kind": "meet",
                    "stage": stage,
                    "task": (tasks or {}).get(partition, partition),
                    "partition": partition,
                    "address": ["127.0.0.1", 5000 + partition],
                }
            )
            answers[partition] = client.receive(timeout=60)
        finally:
            client.close()

    threads = [threading.Thread(target=one, args=(partition,)) for partition in partitions]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return answers


def test_the_meeting_point_answers_every_task_with_every_address_once_all_came():
    meeting = MeetingPoint(3)
    server = MessageServer("127.0.0.1", meeting.on_message)
    try:
        answers = meet(server, [2, 0, 1])
        again = meet(server, [0, 1, 2])  # Spark retried the stage: the same stage id meets anew
    finally:
        server.close()
    for found in (answers, again):
        assert sorted(found) == [0, 1, 2] and all(
            answer["kind"] == "met" for answer in found.values()
        )
        for answer in found.values():
            assert by_partition(answer["addresses"], 3) == [
                ("127.0.0.1", 5000),
                ("127.0.0.1", 5001),
                ("127.0.0.1", 5002),
            ]


def test_tasks_at_the_meeting_point_go_to_allgather_when_one_never_comes(caplog):
    meeting = MeetingPoint(3, patience=0.5)
    server = MessageServer("127.0.0.1", meeting.on_message)
    try:
        with caplog.at_level(logging.WARNING, logger="allreduce_param.engine.movement.rendezvous"):
            answers = meet(server, [0, 2])  # partition 1 cannot reach the driver
    finally:
        server.close()
    assert answers == {0: {"kind": "allgather"}, 2: {"kind": "allgather"}}
    assert "only 2 of 3 tasks reached the driver within 0.5 s" in caplog.text


def test_a_failed_stage_ends_its_meeting_and_a_run_again_meets_as_before():
    """``end()``: the tasks waiting for a peer that failed stop at once (not after the
    patience), a late task of that stage too; the next run's stage meets."""
    meeting = MeetingPoint(3, patience=60)
    arrived = threading.Semaphore(0)

    def on_message(message, reply):
        meeting.on_message(message, reply)
        arrived.release()

    server = MessageServer("127.0.0.1", on_message)
    try:
        answers: dict = {}
        waiting = threading.Thread(target=lambda: answers.update(meet(server, [0, 2])))
        waiting.start()
        assert arrived.acquire(timeout=30) and arrived.acquire(timeout=30)
        meeting.end()
        waiting.join(30)
        late = meet(server, [1])
        again = meet(server, [0, 1, 2], stage=8)
        assert server.drain(30)  # every task's connection has ended
    finally:
        server.close()
    assert answers == {0: {"kind": "ended"}, 2: {"kind": "ended"}}
    assert late == {1: {"kind": "ended"}}
    assert sorted(again) == [0, 1, 2] and {a["kind"] for a in again.values()} == {"met"}


def test_addresses_missing_a_partition_are_refused():
    with pytest.raises(UsageError, match=r"reported partitions \[0, 2\], expected 0..2"):
        by_partition({"0": ["h", 1], "2": ["h", 3]}, 3)


def test_the_bar_says_when_and_why_early_stopping_ended_the_fit(capsys, tmp_path):
    import json

    from allreduce_param.train.driver.progress import ProgressBar
    from allreduce_param.train.result import merge_epoch

    shares = [
        {
            "epoch": 4,
            "partition": p,
            "task": "regression",
            "val": [1.0, 2.0, 10.0],
            "best_epoch": 2,
            "stopped": True,
        }
        for p in range(2)
    ]
    merged = merge_epoch(shares)
    assert merged == {
        "epoch": 4,
        "best_epoch": 2,
        "stopped": True,
        "val_loss": 0.1,
        "val_rmse": pytest.approx(0.2**0.5),
    }
    with open(tmp_path / "log.jsonl", "w") as log:
        bar = ProgressBar(show=True, log_file=log)
        bar("start", {"partition": 0, "steps": 5, "epochs": 10})
        bar("epoch", merged)
        bar.close()
    shown = capsys.readouterr()
    text = shown.out + shown.err
    assert "epoch 4: val_loss 0.1000, val_rmse 0.4472, best epoch 2" in text
    assert (
        "stopped early: no better validation loss since epoch 2, whose weights the fit keeps"
        in text
    )
    assert json.loads((tmp_path / "log.jsonl").read_text())["best_epoch"] == 2


def test_tasks_waiting_at_the_meeting_hold_no_thread_of_the_driver():
    """40 tasks meet; while 39 wait for the last, the message server holds its few threads,
    not one per task, and then every task hears every address."""
    partitions = 40
    meeting = MeetingPoint(partitions, patience=60)
    arrived = []
    server = MessageServer(
        "127.0.0.1",
        lambda message, reply: (
            meeting.on_message(message, reply),
            arrived.append(message["partition"]),
        ),
    )
    clients = [server.client() for _ in range(partitions)]

    def send(partition):
        clients[partition].send(
            {
                "kind": "meet",
                "stage": 3,
                "task": partition,
                "partition": partition,
                "address": ["127.0.0.1", 6000 + partition],
            }
        )

    def message_threads():
        return sum(thread.name == "allreduce-messages" for thread in threading.enumerate())

    try:
        for partition in range(partitions - 1):
            send(partition)
        deadline = time.monotonic() + 60
        while len(arrived) < partitions - 1:
            assert time.monotonic() < deadline, (
                f"{len(arrived)} of {partitions - 1} meet messages handled"
            )
            time.sleep(0.01)
        assert 1 <= message_threads() <= MessageServer.THREADS
        send(partitions - 1)
        answers = [client.receive(timeout=60) for client in clients]
        assert all(
            answer["kind"] == "met" and len(answer["addresses"]) == partitions for answer in answers
        )
        assert message_threads() <= MessageServer.THREADS
    finally:
        for client in clients:
            client.close()
        server.close()
    assert message_threads() == 0


def test_a_task_that_left_before_its_meeting_was_decided_does_not_keep_the_others_from_hearing():
    meeting = MeetingPoint(3, patience=60)
    arrived = []
    server = MessageServer(
        "127.0.0.1",
        lambda message, reply: (
            meeting.on_message(message, reply),
            arrived.append(message["partition"]),
        ),
    )
    gone = server.client()
    try:
        gone.send(
            {"kind": "meet", "stage": 4, "task": 0, "partition": 0, "address": ["127.0.0.1", 7000]}
        )
        deadline = time.monotonic() + 60
        while arrived != [0]:
            assert time.monotonic() < deadline, "the first meet message was not handled"
            time.sleep(0.01)
        gone.close()  # its task failed; Spark will retry it, but the two others are here first
        answers = meet(server, [1, 2], stage=4)
    finally:
        server.close()
    assert sorted(answers) == [1, 2] and all(answer["kind"] == "met" for answer in answers.values())


def test_the_bar_prints_a_line_per_epoch_where_its_output_is_no_terminal():
    """A spark-submit job's log (a file, a pipe): one line per epoch, no carriage-return
    redraws; the line says how far the fit is, its training loss and its pace."""
    from allreduce_param.train.driver.progress import ProgressBar

    log = io.StringIO()  # isatty() is False, as for a file or a pipe
    bar = ProgressBar(show=True, stream=log)
    for partition in range(2):
        bar("start", {"partition": partition, "steps": 4, "epochs": 3})
    for epoch in range(3):
        for step in range(4):
            bar(
                "step",
                {"epoch": epoch, "step": step, "loss": 0.5, "samples": 8, "compute_s": 0.01},
            )
        bar("epoch", {"epoch": epoch, "val_loss": 0.25})
    bar.close()
    text = log.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert [line.split(":")[0] for line in lines] == ["epoch 0", "epoch 1", "epoch 2"]
    assert lines[0].startswith("epoch 0: val_loss 0.2500 (step 4/12, train loss 0.5000, ")
    assert lines[-1].endswith("800 samples/s)") and "step 12/12" in lines[-1]


def test_the_bar_redraws_itself_where_its_output_is_a_terminal():
    from allreduce_param.train.driver.progress import redraws

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    assert redraws(Terminal()) and not redraws(io.StringIO())
