"""StepState, the call order of a handle, alone (no peers): the versions a BSP step takes,
and each refusal naming what must come first."""

from __future__ import annotations

import pytest

from allreduce_param import InputError, UsageError
from allreduce_param.engine import Strategy
from allreduce_param.engine.step import StepState


def test_a_bsp_step_takes_its_versions_in_order():
    state = StepState(1, Strategy())
    state.check_init(5)
    assert state.init(5) == 5  # the weights of step 5 (a fit resumed there)
    assert state.weight_read(None).version == 5
    state.weights_read(5)
    version = state.check_put("put_gradients")
    state.put_started(version)
    state.put_done()
    assert (version, state.check_aggregate()) == (5, 5)
    state.aggregated()
    assert state.send() == 6 and state.weight_read(None).version == 6


def after(state: StepState, *calls: str) -> StepState:
    """``state`` once it has gone through ``calls`` (each a transition, its checks first)."""
    for call in calls:
        if call == "init":
            state.check_init(0)
            state.init(0)
        elif call == "put":
            state.put_started(state.check_put("put_gradients"))
            state.put_done()
        elif call == "stream":
            state.put_started(state.check_put("stream_gradients"))
            state.stream_opened()
        elif call == "aggregate":
            state.check_aggregate()
            state.aggregated()
        elif call == "send":
            state.send()
        elif call == "serve":
            state.start_owner()
    return state


@pytest.mark.parametrize(
    "strategy, calls, refused, message",
    [
        (Strategy(), [], lambda s: s.weight_read(None), "get_weights() on partition 0 came before init"),
        (Strategy(), [], lambda s: s.send(), "send_weight_partition() on partition 0 came before init"),
        (Strategy(), ["init"], lambda s: s.check_init(0), "init() was called twice on partition 0"),
        (Strategy(), ["init"], lambda s: s.check_aggregate(), "came before put_gradients()"),
        (Strategy(), ["init", "put"], lambda s: s.check_put("put_gradients"), "called twice"),
        (Strategy(), ["init", "send"], lambda s: s.send(), "with no aggregate_gradient_partition"),
        (Strategy(), ["init", "stream"], lambda s: s.check_aggregate(), "stream is still open"),
        (Strategy(), ["init", "stream"], lambda s: s.check_put("put_gradients"), "stream of the step"),
        (Strategy(), ["init"], lambda s: s.start_owner(), "for the strategies with a background owner"),
        (Strategy(), ["init"], lambda s: s.check_finish(), "finish_updates() came before serve_updates()"),
        (Strategy("asp"), ["init"], lambda s: s.check_aggregate(), "under 'asp' the background owner"),
        (Strategy("asp"), ["init"], lambda s: s.send(), "send_weight_partition() is BSP's"),
        (Strategy("asp"), ["init", "serve"], lambda s: s.start_owner(), "serve_updates() was called twice"),
        (
            Strategy(backup_workers=1),
            ["init"],
            lambda s: s.check_put("put_gradients"),
            "came without a get_weights() before it",
        ),
    ],
)  # fmt: skip
def test_a_call_out_of_order_is_refused_naming_what_comes_first(strategy, calls, refused, message):
    state = after(StepState(0, strategy), *calls)
    with pytest.raises(UsageError) as error:
        refused(state)
    assert message in str(error.value), error.value


def test_a_bad_step_is_an_input_error_and_a_failed_or_closed_handle_takes_no_call():
    state = StepState(2, Strategy())
    with pytest.raises(InputError, match=r"init\(step=-1\) on partition 2: a whole number >= 0"):
        state.check_init(-1)
    state.check_usable("get_weights()", closed=False)
    with pytest.raises(UsageError, match=r"get_weights\(\) on partition 2: the handle is closed"):
        state.check_usable("get_weights()", closed=True)
    state.fail(RuntimeError("first"))
    state.fail(RuntimeError("second"))  # the first failure is the one named
    with pytest.raises(UsageError, match=r"failed in an earlier call \(RuntimeError: first\)"):
        state.check_usable("get_weights()", closed=False)
