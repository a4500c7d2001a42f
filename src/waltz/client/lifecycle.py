"""The lifecycle of one transaction context, as one pure state machine (no I/O, no asyncio, no clock).

The client core feeds every fact about a context in as an :class:`Event`; :meth:`Lifecycle.handle` moves it
to its next :class:`State` and says which application hook that transition owes (:class:`Hook`). The core
calls the hook; it never decides a context's fate with flags of its own. The table also says which runs hold
one of their partition's slots (:data:`HOLDS_SLOT`: from ADMITTED until the context is committed or ended;
the core gives the slot back on the transition that leaves them) and when a run is over (ENDED: once the hook
that transition owes has run, or at once if it owes none). The whole table::

    state       event       next        hook                      why
    ----------  ----------  ----------  ------------------------  ------------------------------------------
    SUBMITTED   ADMIT       ADMITTED    -                         a slot of the partition taken
    ADMITTED    EXECUTE     EXECUTING   -                         first attempt (and the mount obtained)
    EXECUTING   SEND        APPENDING   -                         execute() filled the builder; sent
    EXECUTING   QUEUE       QUEUED      -                         another context of ours holds a write lock
    EXECUTING   GIVE_UP     ENDED       on_completion(False)      execute() returned False
    QUEUED      TURN        RETRY       -                         the holder's transaction applied (or failed)
    APPENDING   COMMIT      COMMITTED   on_completion(True)       our request id came back in the feed
    APPENDING   LOCK_FAIL   RETRY       on_lock_failure           released once the conflict is applied
    APPENDING   LOST        RETRY       -                         failed without a reason: back off
    RETRY       EXECUTE     EXECUTING   -                         the next attempt
    COMMITTED   COMPLETE    COMPLETED   -                         on_completion(True) ran; not applied yet
    COMMITTED   APPLY       APPLIED     -                         applied before on_completion(True) ran
    COMPLETED   APPLY       ENDED       on_application           this client applied the transaction
    APPLIED     COMPLETE    ENDED       on_application           on_completion(True) ran, after the apply
    any live    FAIL        ENDED       on_exception              execute raised, timeout, partition lost...
    any live    CLOSE       ENDED       on_exception              the client closed (ClientClosedError)
    SUBMITTED,  EXPIRE      ENDED       on_exception              client.transactionTimeout passed
    ADMITTED,
    QUEUED,
    RETRY
    SUBMITTED,  DROP        ENDED       -                         submit() was cancelled: the context dropped
    ADMITTED,
    EXECUTING
    COMMITTED,  FAIL/CLOSE  ENDED       -                         committed: no exception; no on_application
    COMPLETED,
    APPLIED
    EXECUTING,  EXPIRE      (same)      -                         not now: execute() or the append in flight
    APPENDING,                                                    decides; expiry is checked again before
    COMMITTED,                                                    the next attempt
    COMPLETED,
    APPLIED
    ENDED       FAIL/CLOSE/ (same)      -                         terminal: the hook was already owed once
                EXPIRE/DROP/                                      (COMPLETE: on_completion(True) ran for a
                COMPLETE/APPLY                                    context ended meanwhile; the run is over)

Any other (state, event) pair is a bug in the caller and raises :class:`LifecycleError`.
"""

from __future__ import annotations

import enum

from waltz.errors import LifecycleError

__all__ = ["HOLDS_SLOT", "STEPS", "TRANSITIONS", "Event", "Hook", "Lifecycle", "LifecycleError", "State"]


class State(enum.Enum):
    # Members are singletons compared by identity: hash them by identity too, in C (Enum's own __hash__ is
    # Python code, and every transition looks up two of them).
    __hash__ = object.__hash__

    SUBMITTED = "submitted"
    """Accepted by ``submit``; waiting for a slot of its partition."""
    ADMITTED = "admitted"
    """Holds a slot; not executed yet (waiting for the mount)."""
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
    COMPLETED = "completed"
    """Appended, ``on_completion(True)`` ran; ``on_application`` is owed once this client applied it."""
    APPLIED = "applied"
    """Appended and applied; ``on_application`` is owed once ``on_completion(True)`` ran."""
    ENDED = "ended"
    """Terminal: no more attempts and no more hooks."""


class Event(enum.Enum):
    # Members are singletons compared by identity: hash them by identity too, in C (Enum's own __hash__ is
    # Python code, and every transition looks up two of them).
    __hash__ = object.__hash__

    ADMIT = "admit"
    EXECUTE = "execute"
    SEND = "send"
    QUEUE = "queue"
    GIVE_UP = "give up"
    TURN = "turn"
    COMMIT = "commit"
    LOCK_FAIL = "lock failure"
    LOST = "lost"
    COMPLETE = "complete"
    APPLY = "apply"
    DROP = "drop"
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
_LIVE = (S.SUBMITTED, S.ADMITTED, S.EXECUTING, S.QUEUED, S.APPENDING, S.RETRY)
_APPENDED = (S.COMMITTED, S.COMPLETED, S.APPLIED)

TRANSITIONS: dict[tuple[State, Event], tuple[State, Hook | None]] = {
    (S.SUBMITTED, E.ADMIT): (S.ADMITTED, None),
    (S.ADMITTED, E.EXECUTE): (S.EXECUTING, None),
    (S.EXECUTING, E.SEND): (S.APPENDING, None),
    (S.EXECUTING, E.QUEUE): (S.QUEUED, None),
    (S.EXECUTING, E.GIVE_UP): (S.ENDED, H.GAVE_UP),
    (S.QUEUED, E.TURN): (S.RETRY, None),
    (S.APPENDING, E.COMMIT): (S.COMMITTED, H.COMPLETED),
    (S.APPENDING, E.LOCK_FAIL): (S.RETRY, H.LOCK_FAILURE),
    (S.APPENDING, E.LOST): (S.RETRY, None),
    (S.RETRY, E.EXECUTE): (S.EXECUTING, None),
    (S.COMMITTED, E.COMPLETE): (S.COMPLETED, None),
    (S.COMMITTED, E.APPLY): (S.APPLIED, None),
    (S.COMPLETED, E.APPLY): (S.ENDED, H.APPLICATION),
    (S.APPLIED, E.COMPLETE): (S.ENDED, H.APPLICATION),
    **{(state, E.FAIL): (S.ENDED, H.EXCEPTION) for state in _LIVE},
    **{(state, E.CLOSE): (S.ENDED, H.EXCEPTION) for state in _LIVE},
    **{(state, E.EXPIRE): (S.ENDED, H.EXCEPTION) for state in (S.SUBMITTED, S.ADMITTED, S.QUEUED, S.RETRY)},
    **{(state, E.DROP): (S.ENDED, None) for state in (S.SUBMITTED, S.ADMITTED, S.EXECUTING)},
    **{(state, event): (S.ENDED, None) for state in _APPENDED for event in (E.FAIL, E.CLOSE)},
    **{(state, E.EXPIRE): (state, None) for state in (S.EXECUTING, S.APPENDING, *_APPENDED)},
    **{(S.ENDED, e): (S.ENDED, None) for e in (E.FAIL, E.CLOSE, E.EXPIRE, E.DROP, E.COMPLETE, E.APPLY)},
}
"""``(state, event) -> (next state, hook owed)``; see the module docstring."""

STEPS: dict[Event, dict[State, tuple[State, Hook | None]]] = {
    event: {state: TRANSITIONS[(state, e)] for (state, e) in TRANSITIONS if e is event} for event in Event
}
""":data:`TRANSITIONS` by event: ``STEPS[event][state]``. The same table, for the client core's hot path:
:class:`Lifecycle`'s methods for the transitions every append makes look the next state up in maps made from
these rows instead of calling :meth:`Lifecycle.handle` (a missing state is still handed to ``handle``, which
raises)."""

HOLDS_SLOT = frozenset({S.ADMITTED, S.EXECUTING, S.QUEUED, S.APPENDING, S.RETRY})
"""The states of a run that holds one of its partition's slots (``client.maxConcurrentTransactions``)."""

# Module constants for what handle() compares on every call (an enum member lookup costs far more in 3.11).
_SEND, _COMPLETED, _APPLIED = Event.SEND, State.COMPLETED, State.APPLIED
# The rows of the transitions every append makes, from which the maps below are made.
_ADMIT_ROW, _EXECUTE_ROW, _SEND_ROW = STEPS[Event.ADMIT], STEPS[Event.EXECUTE], STEPS[Event.SEND]
_COMMIT_ROW, _COMPLETE_ROW, _APPLY_ROW = STEPS[Event.COMMIT], STEPS[Event.COMPLETE], STEPS[Event.APPLY]


def _composed(*rows: dict[State, tuple[State, Hook | None]]) -> dict[State, State]:
    """``state -> the state after the rows' transitions in turn``, for each state all of them take: several
    steps of the table in one lookup, for the methods below that make them together."""
    out: dict[State, State] = {}
    for start in State:
        state: State | None = start
        for row in rows:
            step = row.get(state) if state is not None else None
            state = step[0] if step is not None else None
        if state is not None:
            out[start] = state
    return out


# Each transition one lookup (the rows hold (state, hook) pairs; these the next state only).
_EXECUTE_NEXT, _SEND_NEXT = _composed(_EXECUTE_ROW), _composed(_SEND_ROW)
_COMMIT_NEXT, _COMPLETE_NEXT = _composed(_COMMIT_ROW), _composed(_COMPLETE_ROW)
_APPLY_NEXT = _composed(_APPLY_ROW)
_ADMIT_EXECUTE = _composed(_ADMIT_ROW, _EXECUTE_ROW)
_ADMIT_EXECUTE_SEND = _composed(_ADMIT_ROW, _EXECUTE_ROW, _SEND_ROW)
_COMMIT_COMPLETE = _composed(_COMMIT_ROW, _COMPLETE_ROW)


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

    # The transitions every append makes, for the client core's hot path: each is handle() made with one
    # lookup in the event's row of the table (none owes a hook but the one its name or result says).

    def admit_execute(self) -> None:
        """``handle(ADMIT)`` then ``handle(EXECUTE)``: a first attempt that took its slot and executed."""
        try:
            self.state = _ADMIT_EXECUTE[self.state]
        except KeyError:
            self.handle(Event.ADMIT)  # Raises LifecycleError (or EXECUTE below does).
            self.handle(Event.EXECUTE)
            raise

    def admit_execute_send(self) -> None:
        """``handle(ADMIT)``, ``handle(EXECUTE)`` then ``handle(SEND)``: a first attempt that took its slot
        and executed off the loop (or on it, before this) is sent."""
        try:
            self.state = _ADMIT_EXECUTE_SEND[self.state]
        except KeyError:
            self.admit_execute()  # Raises LifecycleError (or SEND below does).
            self.handle(_SEND)
            raise
        self.attempts += 1

    def execute(self) -> None:
        """``handle(EXECUTE)``: an attempt executes (no hook)."""
        try:
            self.state = _EXECUTE_NEXT[self.state]
        except KeyError:
            self.handle(Event.EXECUTE)  # Raises LifecycleError.
            raise

    def send(self) -> None:
        """``handle(SEND)``: the attempt's append is sent (no hook); counted in :attr:`attempts`."""
        try:
            self.state = _SEND_NEXT[self.state]
        except KeyError:
            self.handle(_SEND)  # Raises LifecycleError.
            raise
        self.attempts += 1

    def commit(self) -> None:
        """``handle(COMMIT)``: the append committed; ``on_completion(True)`` is owed."""
        try:
            self.state = _COMMIT_NEXT[self.state]
        except KeyError:
            self.handle(Event.COMMIT)  # Raises LifecycleError.
            raise

    def commit_complete(self) -> None:
        """``handle(COMMIT)`` then ``handle(COMPLETE)``: the append committed and the ``on_completion(True)``
        that owes was run at once (inline mode); ``on_application`` follows the apply."""
        try:
            self.state = _COMMIT_COMPLETE[self.state]
        except KeyError:
            self.handle(Event.COMMIT)  # Raises LifecycleError (or COMPLETE below does).
            self.handle(Event.COMPLETE)
            raise

    def complete(self) -> bool:
        """``handle(COMPLETE)``: ``on_completion(True)`` ran. True if ``on_application`` is owed now (the
        transaction was applied meanwhile); False if that waits for the apply (COMPLETED), or the context
        ended meanwhile (ENDED: the run is over)."""
        before = self.state
        try:
            self.state = _COMPLETE_NEXT[before]
        except KeyError:
            self.handle(Event.COMPLETE)  # Raises LifecycleError.
            raise
        return before is _APPLIED

    def apply(self) -> bool:
        """``handle(APPLY)``: this client applied the transaction. True if ``on_application`` is owed now
        (``on_completion(True)`` ran); False if that waits for ``on_completion``, or the context ended
        meanwhile (the client closed, the partition was released: nothing is owed)."""
        before = self.state
        try:
            self.state = _APPLY_NEXT[before]
        except KeyError:
            self.handle(Event.APPLY)  # Raises LifecycleError.
            raise
        return before is _COMPLETED

    def __repr__(self) -> str:
        return f"Lifecycle({self.state.value}, attempts={self.attempts})"
