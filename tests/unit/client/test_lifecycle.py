"""The context lifecycle machine: every (state, event) pair, close and expiry in every state, and the paths
a context takes through the client core."""

from __future__ import annotations

import itertools

import pytest

from waltz.client.lifecycle import (
    HOLDS_SLOT,
    STEPS,
    TRANSITIONS,
    Event,
    Hook,
    Lifecycle,
    LifecycleError,
    State,
)


def at(state: State) -> Lifecycle:
    lifecycle = Lifecycle()
    lifecycle.state = state
    return lifecycle


@pytest.mark.parametrize(("state", "event"), list(itertools.product(State, Event)))
def test_the_rows_by_event_are_the_table(state: State, event: Event) -> None:
    # The core's hot path applies EXECUTE, SEND, COMMIT and APPLY through STEPS: exactly TRANSITIONS.
    assert STEPS[event].get(state) == TRANSITIONS.get((state, event))


@pytest.mark.parametrize(("state", "event"), list(itertools.product(State, Event)))
def test_every_state_and_event_either_follows_the_table_or_is_refused(state: State, event: Event) -> None:
    lifecycle = at(state)
    if (state, event) in TRANSITIONS:
        expected_state, expected_hook = TRANSITIONS[(state, event)]
        assert lifecycle.handle(event) is expected_hook
        assert lifecycle.state is expected_state
    else:
        with pytest.raises(LifecycleError, match=f"in state {state.value} cannot {event.value}"):
            lifecycle.handle(event)
        assert lifecycle.state is state  # A refused event changes nothing.


CLOSE_IN_EVERY_STATE = {
    State.SUBMITTED: (State.ENDED, Hook.EXCEPTION),
    State.ADMITTED: (State.ENDED, Hook.EXCEPTION),
    State.EXECUTING: (State.ENDED, Hook.EXCEPTION),
    State.QUEUED: (State.ENDED, Hook.EXCEPTION),
    State.APPENDING: (State.ENDED, Hook.EXCEPTION),
    State.RETRY: (State.ENDED, Hook.EXCEPTION),
    State.COMMITTED: (State.ENDED, None),  # Appended: no exception, and no on_application either.
    State.COMPLETED: (State.ENDED, None),
    State.APPLIED: (State.ENDED, None),
    State.ENDED: (State.ENDED, None),
}

EXPIRY_IN_EVERY_STATE = {
    State.SUBMITTED: (State.ENDED, Hook.EXCEPTION),
    State.ADMITTED: (State.ENDED, Hook.EXCEPTION),
    State.EXECUTING: (State.EXECUTING, None),  # execute() decides; expiry is checked before the next one.
    State.QUEUED: (State.ENDED, Hook.EXCEPTION),
    State.APPENDING: (State.APPENDING, None),  # The append in flight may still commit.
    State.RETRY: (State.ENDED, Hook.EXCEPTION),
    State.COMMITTED: (State.COMMITTED, None),
    State.COMPLETED: (State.COMPLETED, None),
    State.APPLIED: (State.APPLIED, None),
    State.ENDED: (State.ENDED, None),
}


@pytest.mark.parametrize("state", list(State))
def test_close_in_every_state(state: State) -> None:
    lifecycle = at(state)
    expected_state, expected_hook = CLOSE_IN_EVERY_STATE[state]
    assert lifecycle.handle(Event.CLOSE) is expected_hook
    assert lifecycle.state is expected_state


@pytest.mark.parametrize("state", list(State))
def test_expiry_in_every_state(state: State) -> None:
    lifecycle = at(state)
    expected_state, expected_hook = EXPIRY_IN_EVERY_STATE[state]
    assert lifecycle.handle(Event.EXPIRE) is expected_hook
    assert lifecycle.state is expected_state


def run_events(*events: Event) -> tuple[Lifecycle, list[Hook]]:
    lifecycle = Lifecycle()
    hooks = [h for h in (lifecycle.handle(e) for e in events) if h is not None]
    return lifecycle, hooks


def test_appended_at_the_first_attempt() -> None:
    lifecycle, hooks = run_events(
        Event.ADMIT, Event.EXECUTE, Event.SEND, Event.COMMIT, Event.COMPLETE, Event.APPLY
    )
    assert hooks == [Hook.COMPLETED, Hook.APPLICATION]
    assert lifecycle.state is State.ENDED
    assert lifecycle.attempts == 1


def test_lock_failure_then_lost_append_then_commit() -> None:
    lifecycle, hooks = run_events(
        Event.ADMIT, Event.EXECUTE, Event.SEND, Event.LOCK_FAIL,
        Event.EXECUTE, Event.SEND, Event.LOST,
        Event.EXECUTE, Event.SEND, Event.COMMIT,
    )  # fmt: skip
    assert hooks == [Hook.LOCK_FAILURE, Hook.COMPLETED]
    assert lifecycle.state is State.COMMITTED
    assert lifecycle.state not in HOLDS_SLOT  # Its slot is free, though on_application is still owed.
    assert lifecycle.attempts == 3


def test_a_queued_execution_is_not_an_attempt() -> None:
    lifecycle, hooks = run_events(
        Event.ADMIT, Event.EXECUTE, Event.QUEUE, Event.TURN, Event.EXECUTE, Event.SEND, Event.COMMIT
    )
    assert hooks == [Hook.COMPLETED]
    assert lifecycle.attempts == 1


def test_giving_up_and_raising_end_the_context_once() -> None:
    lifecycle, hooks = run_events(Event.ADMIT, Event.EXECUTE, Event.GIVE_UP, Event.CLOSE, Event.FAIL)
    assert hooks == [Hook.GAVE_UP]
    lifecycle, hooks = run_events(Event.ADMIT, Event.EXECUTE, Event.FAIL, Event.CLOSE)
    assert hooks == [Hook.EXCEPTION]
    assert lifecycle.state is State.ENDED


def test_nothing_happens_to_an_ended_context() -> None:
    lifecycle, _ = run_events(Event.ADMIT, Event.EXECUTE, Event.GIVE_UP)
    for event in (Event.ADMIT, Event.EXECUTE, Event.SEND, Event.COMMIT, Event.TURN):
        with pytest.raises(LifecycleError):
            lifecycle.handle(event)


def test_on_application_follows_on_completion_whichever_comes_first() -> None:
    # Applied before on_completion(True) ran: on_application is owed once it has.
    lifecycle = at(State.COMMITTED)
    assert lifecycle.apply() is False
    assert lifecycle.state is State.APPLIED
    assert lifecycle.complete() is True
    assert lifecycle.state is State.ENDED
    # on_completion(True) ran first: on_application is owed at the apply.
    lifecycle = at(State.COMMITTED)
    assert lifecycle.complete() is False
    assert lifecycle.state is State.COMPLETED
    assert lifecycle.apply() is True
    assert lifecycle.state is State.ENDED


def test_a_context_ended_while_on_completion_ran_owes_nothing_more() -> None:
    lifecycle = at(State.COMMITTED)
    assert lifecycle.handle(Event.FAIL) is None  # The partition was released.
    assert lifecycle.complete() is False
    assert lifecycle.apply() is False
    assert lifecycle.state is State.ENDED


def test_a_slot_is_held_from_admission_until_the_context_is_appended_or_ends() -> None:
    lifecycle = Lifecycle()
    held = []
    for event in (
        Event.ADMIT,
        Event.EXECUTE,
        Event.SEND,
        Event.LOST,
        Event.EXECUTE,
        Event.SEND,
        Event.COMMIT,
    ):
        held.append(lifecycle.state in HOLDS_SLOT)
        lifecycle.handle(event)
    held.append(lifecycle.state in HOLDS_SLOT)
    assert held == [False, True, True, True, True, True, True, False]
    for path in ((Event.DROP,), (Event.ADMIT, Event.DROP), (Event.ADMIT, Event.EXPIRE)):
        lifecycle, _ = run_events(*path)
        assert lifecycle.state is State.ENDED
        assert lifecycle.state not in HOLDS_SLOT


def test_the_fast_methods_are_the_table() -> None:
    lifecycle = Lifecycle()
    lifecycle.admit_execute()
    assert lifecycle.state is State.EXECUTING
    lifecycle.send()
    assert (lifecycle.state, lifecycle.attempts) == (State.APPENDING, 1)
    lifecycle.commit()
    assert lifecycle.state is State.COMMITTED
    with pytest.raises(LifecycleError):
        lifecycle.send()
    with pytest.raises(LifecycleError):
        at(State.EXECUTING).admit_execute()
