"""The client's task ownership: :class:`waltz.runtime.TaskSet`, shared with the storage node (see there)."""

from waltz.runtime import FailureHandler, TaskSet

__all__ = ["FailureHandler", "TaskSet"]
