"""The lifecycle of one transaction context, as one pure state machine (no I/O, no asyncio, no clock).

The client core feeds every fact about a context in as an :class:`Event`; :meth:`Lifecycle.handle` moves it
to its next :class:`State` and says which application hook that transition owes (:class:`Hook`). The core
calls the hook; it never decides a context's fate with flags of its own. The whole table::

    state       event       next        hook                      why
    ----------  ----------  ----------  ------------------------  ------------------------------------------
    SUBMITTED   EXECUTE     EXECUTING   -                         first attempt (slot and mount obtained)
    EXECUTING   SEND        APPENDING   -                         execute() filled the builder; sent
    EXECUTING   QUEUE       QUEUED      -                         another context of ours holds a write lock
    EXECUTING   GIVE_UP     ENDED       on_completion(False)      execute() returned False
    QUEUED      TURN        RETRY       -                         the holder's transaction applied (or failed)
    APPENDING   COMMIT      COMMITTED   on_completion(True)       our request id came back in the feed
    APPENDING   LOCK_FAIL   RETRY       on_lock_failure           released once the conflict is applied
    APPENDING   LOST        RETRY       -                         failed without a reason: back off
    RETRY       EXECUTE     EXECUTING   -                         the next attempt
    COMMITTED   APPLY       ENDED       on_application           this client applied the transaction
    any live    FAIL        ENDED       on_exception              execute raised, timeout, partition lost...
    any live    CLOSE       ENDED       on_exception              the client closed (ClientClosedError)
    SUBMITTED,  EXPIRE      ENDED       on_exception              client.transactionTimeout passed
    QUEUED,
    RETRY
    COMMITTED   FAIL/CLOSE  ENDED       -                         committed: no exception; no on_application
    EXECUTING,  EXPIRE      (same)      -                         not now: execute() or the append in flight
    APPENDING,                                                    decides; expiry is checked again before
    COMMITTED                                                     the next attempt
    ENDED       FAIL/CLOSE/ (same)      -                         terminal: the hook was already owed once
                EXPIRE

Any other (state, event) pair is a bug in the caller and raises :class:`LifecycleError`.
"""

from __future__ import annotations

import enum

from waltz.errors import LifecycleError

__all__ = ["STEPS", "TRANSITIONS", "Event", "Hook", "Lifecycle", "LifecycleError", "State"]


class State(enum.Enum):
    # Members are singletons compared by identity: hash them by identity too, in C (Enum's own __hash__ is
    # Python code, and every transition looks up two of them).
    __hash__ = object.__hash__

    SUBMITTED = "submitted"
    """Accepted by ``submit``; not executed yet (waiting for a slot or the mount)."""
    EXECUTING = "executing"
    """``execute`` runs, or its builder waits to be sent."""
    QUEUED = "queued"
    """Executed, then queued behind another context of this client holding one of its write locks."""
    APPENDING = "appending"
    """The append was sent; its fate is not known yet."""
    RETRY = "retry"
    """An attempt failed (or a turn came); the context executes again after a backoff or at once."""
    COMMITTED = "committed"
    """Appended: ``on_completion(True)`` is owed, then ``on_application`` once this client applied it."""
    ENDED = "ended"
    """Terminal: no more attempts and no more hooks."""


class Event(enum.Enum):
    # Members are singletons compared by identity: hash them by identity too, in C (Enum's own __hash__ is
    # Python code, and every transition looks up two of them).
    __hash__ = object.__hash__

    EXECUTE = "execute"
    SEND = "send"
    QUEUE = "queue"
    GIVE_UP = "give up"
    TURN = "turn"
    COMMIT = "commit"
    LOCK_FAIL = "lock failure"
    LOST = "lost"
    APPLY = "apply"
    FAIL = "fail"
    CLOSE = "close"
    EXPIRE = "expire"


class Hook(enum.Enum):
    """The application hook a transition owes (the core calls it, with the arguments it holds)."""

    COMPLETED = "on_completion(True)"
    GAVE_UP = "on_completion(False)"
    LOCK_FAILURE = "on_lock_failure"
    APPLICATION = "on_application"
    EXCEPTION = "on_exception"


S, E, H = State, Event, Hook
_LIVE = (S.SUBMITTED, S.EXECUTING, S.QUEUED, S.APPENDING, S.RETRY)

TRANSITIONS: dict[tuple[State, Event], tuple[State, Hook | None]] = {
    (S.SUBMITTED, E.EXECUTE): (S.EXECUTING, None),
    (S.EXECUTING, E.SEND): (S.APPENDING, None),
    (S.EXECUTING, E.QUEUE): (S.QUEUED, None),
    (S.EXECUTING, E.GIVE_UP): (S.ENDED, H.GAVE_UP),
    (S.QUEUED, E.TURN): (S.RETRY, None),
    (S.APPENDING, E.COMMIT): (S.COMMITTED, H.COMPLETED),
    (S.APPENDING, E.LOCK_FAIL): (S.RETRY, H.LOCK_FAILURE),
    (S.APPENDING, E.LOST): (S.RETRY, None),
    (S.RETRY, E.EXECUTE): (S.EXECUTING, None),
    (S.COMMITTED, E.APPLY): (S.ENDED, H.APPLICATION),
    **{(state, E.FAIL): (S.ENDED, H.EXCEPTION) for state in _LIVE},
    **{(state, E.CLOSE): (S.ENDED, H.EXCEPTION) for state in _LIVE},
    **{(state, E.EXPIRE): (S.ENDED, H.EXCEPTION) for state in (S.SUBMITTED, S.QUEUED, S.RETRY)},
    (S.COMMITTED, E.FAIL): (S.ENDED, None),
    (S.COMMITTED, E.CLOSE): (S.ENDED, None),
    **{(state, E.EXPIRE): (state, None) for state in (S.EXECUTING, S.APPENDING, S.COMMITTED)},
    **{(S.ENDED, event): (S.ENDED, None) for event in (E.FAIL, E.CLOSE, E.EXPIRE)},
}
"""``(state, event) -> (next state, hook owed)``; see the module docstring."""

STEPS: dict[Event, dict[State, tuple[State, Hook | None]]] = {
    event: {state: TRANSITIONS[(state, e)] for (state, e) in TRANSITIONS if e is event} for event in Event
}
""":data:`TRANSITIONS` by event: ``STEPS[event][state]``. The same table, for the client core's hot path,
which applies a transition it knows by one lookup in the event's row instead of a call of
:meth:`Lifecycle.handle` (a missing state there is still handed to ``handle``, which raises)."""

# Module constants for what handle() compares on every call (an enum member lookup costs far more in 3.11).
_SEND, _COMMITTED, _ENDED = Event.SEND, State.COMMITTED, State.ENDED
# The rows of the four transitions every append makes, for the methods of the same names below.
_EXECUTE_ROW, _SEND_ROW, _COMMIT_ROW = STEPS[Event.EXECUTE], STEPS[Event.SEND], STEPS[Event.COMMIT]
_APPLIED = STEPS[Event.APPLY][State.COMMITTED][0]


class Lifecycle:
    """The state of one context. ``attempts`` counts the appends sent (what ``client.maxTransactionAttempts``
    bounds: an execution queued behind our own lock holder never reached the server, so it does not count)."""

    __slots__ = ("attempts", "state")

    def __init__(self) -> None:
        self.state = State.SUBMITTED
        self.attempts = 0

    def handle(self, event: Event) -> Hook | None:
        """Apply ``event``; return the hook the transition owes (None for none)."""
        try:
            state, hook = TRANSITIONS[(self.state, event)]
        except KeyError:
            raise LifecycleError(f"a context in state {self.state.value} cannot {event.value}") from None
        if event is _SEND:
            self.attempts += 1
        self.state = state
        return hook

    # The four transitions every append makes, for the client core's hot path: each is handle(event) made
    # with one lookup in the event's row of the table (none owes a hook but the one its name says).

    def execute(self) -> None:
        """``handle(EXECUTE)``: an attempt executes (no hook)."""
        try:
            self.state = _EXECUTE_ROW[self.state][0]
        except KeyError:
            self.handle(Event.EXECUTE)  # Raises LifecycleError.
            raise

    def send(self) -> None:
        """``handle(SEND)``: the attempt's append is sent (no hook); counted in :attr:`attempts`."""
        try:
            self.state = _SEND_ROW[self.state][0]
        except KeyError:
            self.handle(_SEND)  # Raises LifecycleError.
            raise
        self.attempts += 1

    def execute_send(self) -> None:
        """``handle(EXECUTE)`` then ``handle(SEND)``: a first attempt, executed off the loop, is sent."""
        try:
            self.state = _SEND_ROW[_EXECUTE_ROW[self.state][0]][0]
        except KeyError:
            self.handle(Event.EXECUTE)  # Raises LifecycleError (or SEND below does).
            self.handle(_SEND)
            raise
        self.attempts += 1

    def commit(self) -> None:
        """``handle(COMMIT)``: the append committed; ``on_completion(True)`` is owed."""
        try:
            self.state = _COMMIT_ROW[self.state][0]
        except KeyError:
            self.handle(Event.COMMIT)  # Raises LifecycleError.
            raise

    def apply(self) -> bool:
        """``handle(APPLY)`` if the context is committed: True then (``on_application`` is owed); False if it
        ended meanwhile (the client closed, the partition was released: nothing is owed)."""
        state = self.state
        if state is _COMMITTED:
            self.state = _APPLIED
            return True
        if state is not _ENDED:
            self.handle(Event.APPLY)  # Raises LifecycleError.
        return False

    @property
    def ended(self) -> bool:
        """True once no terminal hook remains to be decided (committed, or ended)."""
        return self.state is _COMMITTED or self.state is _ENDED

    def __repr__(self) -> str:
        return f"Lifecycle({self.state.value}, attempts={self.attempts})"
