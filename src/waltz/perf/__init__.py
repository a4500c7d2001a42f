"""Library behind ``waltz perf`` (throughput and latency) and ``waltz client validate`` (serializability).

:mod:`waltz.perf.producer` (``run_producers``, ``run_consumers``), :mod:`waltz.perf.validate`
(``run_validation``), :mod:`waltz.perf.common` (clients, contexts, :class:`~waltz.perf.common.PerfResult`).
All take a ``ClientConfig`` and an optional ``driver_factory`` (a MockDriver in tests).
"""
