"""The exception tree of ``waltz.errors``: failures under WaltzError, bugs under InternalError."""

from __future__ import annotations

import re

import pytest

from waltz import errors
from waltz.client.lifecycle import LifecycleError as LifecycleFromClient
from waltz.server.store.support import InvariantViolation as InvariantFromStore


@pytest.mark.parametrize("bug", [errors.InvariantViolation, errors.LifecycleError, errors.BusyResourceError])
def test_a_bug_is_an_internal_error_that_no_handler_of_failures_catches(bug: type[Exception]) -> None:
    assert issubclass(bug, errors.InternalError)
    assert issubclass(bug, RuntimeError)
    assert not issubclass(bug, errors.WaltzError)  # `except WaltzError` (retry, answer the peer) lets it pass


def test_the_modules_that_raised_them_name_the_same_classes() -> None:
    assert InvariantFromStore is errors.InvariantViolation
    assert LifecycleFromClient is errors.LifecycleError


def test_every_class_of_the_module_is_drawn_in_its_docstring() -> None:
    doc = errors.__doc__ or ""
    classes = [
        name
        for name, value in vars(errors).items()
        if isinstance(value, type) and issubclass(value, Exception) and value.__module__ == errors.__name__
    ]
    assert [name for name in classes if not re.search(rf"(── |^    ){name}\b", doc, re.MULTILINE)] == []
