"""ReadBursts: the partitions a client's read left waiting for more of their appends."""

from __future__ import annotations

from waltz.server.bursts import ReadBursts


class _Part:
    def __init__(self, name: str, ended: list[str]) -> None:
        self.name = name
        self._ended = ended

    def end_burst(self) -> None:
        self._ended.append(self.name)


def test_the_reads_last_append_ends_every_partition_given_one_with_more_behind_it_in_order() -> None:
    ended: list[str] = []
    a, b, c = (_Part(n, ended) for n in "abc")
    bursts = ReadBursts()
    for part in (a, a, b, a, c):
        bursts.took(part, True)
    assert ended == []
    assert bursts.pending == [a, b, a, c]  # a run of one partition once
    bursts.took(b, False)
    assert ended == ["a", "b", "a", "c"]
    assert bursts.pending == []
    bursts.took(c, False)  # a lone append: nothing was waiting
    assert ended == ["a", "b", "a", "c"]


def test_end_releases_them_when_the_read_ends_with_another_request() -> None:
    ended: list[str] = []
    bursts = ReadBursts()
    bursts.took(_Part("a", ended), True)
    bursts.end()
    bursts.end()
    assert ended == ["a"]
