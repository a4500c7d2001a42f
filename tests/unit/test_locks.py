"""Optimistic locks: the Java-compatible client hash and the server lock table's exact semantics."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from waltz.client.locks import PartitionLocalLock, java_long_hash, java_string_hash, lock_hash, lock_hashes
from waltz.protocol.records import to_signed32
from waltz.server.locks import DEFAULT_LOCK_TABLE_SIZE, LockRequest, LockTable, lock_slots

# -- client side: the 32-bit wire value


def java_string_hash_by_formula(text: str) -> int:
    """s[0]*31^(n-1) + ... + s[n-1] over UTF-16 code units, wrapped to a signed 32-bit int like Java's."""
    raw = text.encode("utf-16-be", "surrogatepass")
    units = [int.from_bytes(raw[i : i + 2], "big") for i in range(0, len(raw), 2)]
    n = len(units)
    total = sum(unit * 31 ** (n - 1 - i) for i, unit in enumerate(units))
    return to_signed32(total)


def test_java_string_hash_golden_values() -> None:
    # Values Java prints for "".hashCode(), "a".hashCode(), "hello".hashCode().
    assert java_string_hash("") == 0
    assert java_string_hash("a") == 97
    assert java_string_hash("hello") == 99162322
    # "account": 97*31^6 + 99*31^5 + 99*31^4 + 111*31^3 + 117*31^2 + 110*31 + 116 = 89016994349. Java's int
    # keeps the low 32 bits (89016994349 - 20 * 2^32 = 3117648429) and reads them signed: 3117648429 - 2^32.
    by_hand = 97 * 31**6 + 99 * 31**5 + 99 * 31**4 + 111 * 31**3 + 117 * 31**2 + 110 * 31 + 116
    assert by_hand == 89016994349
    assert by_hand - 20 * 2**32 == 3117648429
    assert java_string_hash("account") == 3117648429 - 2**32 == -1177318867
    # Outside the BMP a character is two UTF-16 code units: U+1F600 = 0xD83D 0xDE00.
    assert java_string_hash("\U0001f600") == 0xD83D * 31 + 0xDE00 == 1772899


@given(st.text(max_size=40))
def test_java_string_hash_matches_the_formula(text: str) -> None:
    assert java_string_hash(text) == java_string_hash_by_formula(text)


def test_java_long_hash_golden_values() -> None:
    assert java_long_hash(0) == 0
    assert java_long_hash(1) == 1
    assert java_long_hash(42) == 42
    assert java_long_hash(-1) == 0  # 0xFFFFFFFF ^ 0xFFFFFFFF
    assert java_long_hash(2**32) == 1
    assert java_long_hash(2**63 - 1) == -(2**31)  # Long.MAX_VALUE
    assert java_long_hash(-(2**63)) == -(2**31)  # Long.MIN_VALUE


def test_lock_hash_is_string_hash_xor_long_hash() -> None:
    lock = PartitionLocalLock("account", 42)
    assert lock_hash(lock) == -1177318867 ^ 42 == -1177318905
    assert lock.hash32() == lock_hash(lock)
    assert lock_hash(PartitionLocalLock("", 0)) == 0
    assert lock_hashes([lock, PartitionLocalLock("a", 1)]) == (-1177318905, 97 ^ 1)


@given(st.text(max_size=20), st.integers(-(2**63), 2**63 - 1))
def test_lock_hash_is_a_signed_32_bit_int(name: str, lock_id: int) -> None:
    value = lock_hash(PartitionLocalLock(name, lock_id))
    assert -(2**31) <= value < 2**31


@given(
    st.text(max_size=20),
    st.integers(-(2**63), 2**63 - 1) | st.sampled_from([0, 2**31 - 1, 2**31, -1, 2**32, -(2**31)]),
)
def test_lock_hash_is_the_string_hash_xor_the_long_hash_on_both_of_its_paths(name: str, lock_id: int) -> None:
    # lock_hash has a shortcut for ids in 0..2**31-1 (Long.hashCode is the id there): the same values.
    assert lock_hash(PartitionLocalLock(name, lock_id)) == java_string_hash(name) ^ java_long_hash(lock_id)


def test_partition_local_lock_is_a_frozen_hashable_value() -> None:
    a, b = PartitionLocalLock("x", 1), PartitionLocalLock("x", 1)
    assert a == b
    assert len({a, b, PartitionLocalLock("x", 2)}) == 2
    with pytest.raises(AttributeError):
        a.id = 3  # type: ignore[misc]
    with pytest.raises(ValueError, match="64-bit"):
        PartitionLocalLock("x", 2**63)


def test_partition_local_lock_keeps_its_dataclass_behaviour() -> None:
    # Its __init__ is written out (no generated one): keywords, bounds, repr, copies and pickling as before.
    import copy
    import dataclasses
    import pickle

    lock = PartitionLocalLock(name="x", id=-(2**63))
    assert (lock.name, lock.id) == ("x", -(2**63))
    assert repr(lock) == "PartitionLocalLock(name='x', id=-9223372036854775808)"
    assert pickle.loads(pickle.dumps(lock)) == copy.copy(lock) == lock
    assert dataclasses.replace(lock, id=5) == PartitionLocalLock("x", 5)
    assert [f.name for f in dataclasses.fields(lock)] == ["name", "id"]
    with pytest.raises(ValueError, match="64-bit"):
        PartitionLocalLock("x", -(2**63) - 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        lock.name = "y"  # type: ignore[misc]


# -- server side: slots


def java_slots(lock: int, size: int) -> list[int]:
    """The original's hash functions with Java int semantics spelled out (signed wrap after every step)."""
    h = to_signed32(lock)
    out = []
    for _ in range(3):
        h = to_signed32(h * 1103515245 + 12345)
        out.append((h & 0x3FFFFFFF) % size)
    return out


def test_lock_slots_golden_values() -> None:
    # 0 -> 12345 -> 3554416254 -> 2802067423; low 30 bits mod 30000.
    assert lock_slots(0, DEFAULT_LOCK_TABLE_SIZE) == (12345, 10782, 13775)
    assert lock_slots(1, DEFAULT_LOCK_TABLE_SIZE) == (25766, 1575, 4084)
    assert lock_slots(-1, DEFAULT_LOCK_TABLE_SIZE) == (10748, 19989, 23466)


@given(st.integers(-(2**31), 2**31 - 1), st.integers(1, 100_000))
def test_lock_slots_match_java_int_arithmetic(lock: int, size: int) -> None:
    assert list(lock_slots(lock, size)) == java_slots(lock, size)


# -- server side: semantics per lock kind

L, M = 1001, 2002


def begun(
    table: LockTable, write: tuple[int, ...] = (), read: tuple[int, ...] = (), append: tuple[int, ...] = ()
) -> LockRequest:
    request = table.begin(write, read, append)
    assert request is not None
    return request


def commit_and_release(table: LockTable, request: LockRequest, txn: int) -> None:
    table.commit(request, txn)
    table.release(request)


def test_write_lock_is_checked_and_advanced() -> None:
    table = LockTable(initial_high_water_mark=10)
    request = begun(table, write=(L,))
    assert table.estimate(request) == 10
    assert table.check(request, 10) is None
    assert table.check(request, 9) == 10  # the client computed the transaction before id 10 existed
    commit_and_release(table, request, 11)
    assert table.lock_high_water_mark(L) == 11

    stale = begun(table, write=(L,))
    assert table.check(stale, 10) == 11
    table.release(stale)
    fresh = begun(table, write=(L,))
    assert table.check(fresh, 11) is None


def test_read_lock_is_checked_but_never_advanced() -> None:
    table = LockTable(initial_high_water_mark=10)
    reader = begun(table, read=(L,))
    assert table.check(reader, 10) is None
    commit_and_release(table, reader, 11)
    assert table.lock_high_water_mark(L) == 10  # reading does not invalidate other readers or writers

    commit_and_release(table, begun(table, write=(L,)), 12)
    reader = begun(table, read=(L,))
    assert table.check(reader, 11) == 12  # but a newer write conflicts with a read
    assert table.check(reader, 12) is None


def test_append_lock_is_advanced_but_never_checked() -> None:
    table = LockTable(initial_high_water_mark=10)
    commit_and_release(table, begun(table, write=(L,)), 20)
    appender = begun(table, append=(L,))
    assert table.estimate(appender) == -1
    assert table.check(appender, -1) is None  # never fails, however stale the client
    commit_and_release(table, appender, 21)
    assert table.lock_high_water_mark(L) == 21

    # ... yet it invalidates others' write and read locks.
    writer = begun(table, write=(L,))
    assert table.check(writer, 20) == 21
    table.release(writer)
    reader = begun(table, read=(L,))
    assert table.check(reader, 20) == 21


def test_estimate_is_max_over_locks_of_min_over_slots() -> None:
    table = LockTable(size=1000, initial_high_water_mark=5)
    commit_and_release(table, begun(table, write=(L,)), 7)
    request = begun(table, write=(M,), read=(L,))
    assert table.estimate(request) == 7
    assert table.estimate(begun(LockTable(initial_high_water_mark=5))) == -1  # no write or read locks
    # One raised slot alone does not raise a lock's estimate: the minimum of its three slots counts.
    table._hwms[lock_slots(M, 1000)[0]] = 99
    assert table.lock_high_water_mark(M) == 5


def test_busy_slots_block_every_kind_until_release() -> None:
    table = LockTable()
    holder = begun(table, write=(L,))
    assert table.begin((L,), (), ()) is None
    assert table.begin((), (L,), ()) is None  # read locks also wait on in-flight writes
    assert table.begin((), (), (L,)) is None
    assert table.begin((M,), (), ()) is not None  # other locks are unaffected
    table.release(holder)
    assert table.begin((), (L,), ()) is not None


def test_append_locks_are_busy_too_and_read_locks_are_not() -> None:
    table = LockTable()
    begun(table, append=(L,))
    assert table.begin((), (L,), ()) is None
    table2 = LockTable()
    begun(table2, read=(L,))
    assert table2.busy_slots() == 0
    assert table2.begin((L,), (), ()) is not None  # an in-flight reader does not block a writer


def test_failed_begin_takes_nothing() -> None:
    table = LockTable()
    begun(table, write=(L,))
    before = table.busy_slots()
    assert table.begin((M, L), (), ()) is None
    assert table.busy_slots() == before
    assert table.begin((M,), (), ()) is not None


def test_release_is_idempotent_and_ignores_requests_from_before_a_reset() -> None:
    table = LockTable()
    old = begun(table, write=(L,))
    table.release(old)
    table.release(old)
    assert table.busy_slots() == 0

    stale = begun(table, write=(L,))
    table.reset(50)
    assert table.busy_slots() == 0
    new = begun(table, write=(L,))
    busy = table.busy_slots()
    table.release(stale)  # must not free the slots the new request holds
    assert table.busy_slots() == busy
    table.release(new)
    assert table.busy_slots() == 0


def test_reset_sets_every_slot_and_clears_busy() -> None:
    table = LockTable(size=100, initial_high_water_mark=-1)
    commit_and_release(table, begun(table, write=(L,)), 30)
    begun(table, write=(M,))
    table.reset(42)
    assert table.busy_slots() == 0
    assert set(table._hwms) == {42}
    assert table.check(begun(table, write=(L,)), 41) == 42


def test_commit_never_lowers_a_slot() -> None:
    table = LockTable(initial_high_water_mark=10)
    late = begun(table, write=(L,))
    table.reset(100)
    table.commit(late, 50)
    assert table.lock_high_water_mark(L) == 100


def test_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        LockTable(size=0)


# -- collisions never hide a conflict

lock_values = st.integers(0, 40) | st.integers(-(2**31), 2**31 - 1)
lock_lists = st.lists(lock_values, max_size=4).map(tuple)
operations = st.one_of(
    st.tuples(st.just("append"), lock_lists, lock_lists, lock_lists, st.integers(0, 30)),
    st.tuples(st.just("reset"), st.just(()), st.just(()), st.just(()), st.just(0)),
)


@settings(max_examples=300)
@given(st.integers(1, 60), st.integers(-1, 5), st.lists(operations, max_size=60))
def test_table_never_misses_a_conflict_the_exact_model_sees(
    size: int, initial: int, ops: list[tuple[str, tuple[int, ...], tuple[int, ...], tuple[int, ...], int]]
) -> None:
    # A tiny table makes collisions frequent; the exact model is the mock driver's per-lock map.
    table = LockTable(size=size, initial_high_water_mark=initial)
    exact: dict[int, int] = {}
    hwm = initial
    for kind, write, read, append, staleness in ops:
        if kind == "reset":
            table.reset(hwm)
            continue
        client_hwm = max(initial, hwm - staleness)
        request = table.begin(write, read, append)
        assert request is not None  # sequential appends: nothing is ever busy here
        exact_estimate = max((exact.get(lock, initial) for lock in write + read), default=-1)
        assert table.estimate(request) >= exact_estimate
        conflict = table.check(request, client_hwm)
        if exact_estimate > client_hwm:
            assert conflict is not None
            assert conflict >= exact_estimate
        if conflict is None:
            hwm += 1
            table.commit(request, hwm)
            for lock in write + append:
                exact[lock] = hwm
        table.release(request)
        assert table.busy_slots() == 0


@given(st.lists(st.tuples(lock_lists, lock_lists, lock_lists), max_size=30), st.integers(1, 40))
def test_begin_never_shares_a_busy_slot(requests: list[tuple[tuple[int, ...], ...]], size: int) -> None:
    table = LockTable(size=size)
    held: list[LockRequest] = []
    for write, read, append in requests:
        request = table.begin(write, read, append)
        if request is None:
            continue
        for other in held:
            assert not (set(request.updated) & set(other.updated))
            touched = {slot for triple in request.checked for slot in triple}
            assert not (touched & set(other.updated))
        held.append(request)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(-(2**31), 2**31 - 1), max_size=3),
    st.lists(st.integers(-(2**31), 2**31 - 1), max_size=3),
    st.lists(st.integers(-(2**31), 2**31 - 1), max_size=3),
    st.integers(0, 100),
)
def test_one_call_commit_and_release_is_commit_then_release(
    write: list[int], read: list[int], append: list[int], txn: int
) -> None:
    one, two = LockTable(size=17, initial_high_water_mark=5), LockTable(size=17, initial_high_water_mark=5)
    a, b = (
        one.begin(tuple(write), tuple(read), tuple(append)),
        two.begin(tuple(write), tuple(read), tuple(append)),
    )
    assert a is not None
    assert b is not None
    assert (a.checked, a.updated) == (b.checked, b.updated)
    one.commit_and_release(a, txn)
    two.commit(b, txn)
    two.release(b)
    assert a.released
    assert b.released
    assert one.busy_slots() == two.busy_slots() == 0
    for lock in [*write, *read, *append, 0, 1, 2]:
        assert one.lock_high_water_mark(lock) == two.lock_high_water_mark(lock)


@settings(max_examples=300, deadline=None)
@given(
    st.integers(1, 40),
    st.lists(
        st.tuples(
            st.lists(st.integers(-(2**31), 2**31 - 1), min_size=0, max_size=2),
            st.lists(st.integers(-(2**31), 2**31 - 1), max_size=1),
            st.lists(st.integers(-(2**31), 2**31 - 1), max_size=1),
            st.integers(-1, 12),
            st.sampled_from(["hold", "commit", "fail"]),
        ),
        max_size=40,
    ),
)
def test_begin_checked_is_begin_then_check_then_release_on_conflict(
    size: int, ops: list[tuple[list[int], list[int], list[int], int, str]]
) -> None:
    # Two tables driven alike, one with the one-call fast path, one with the separate calls; appends are
    # held in flight (so busy slots matter), committed or failed, and the tables must agree throughout.
    one, two = (
        LockTable(size=size, initial_high_water_mark=3),
        LockTable(size=size, initial_high_water_mark=3),
    )
    held: list[tuple[LockRequest, LockRequest]] = []
    txn = 3
    for write, read, append, client_hwm, fate in ops:
        w, r, a = tuple(write), tuple(read), tuple(append)
        got = one.begin_checked(w, r, a, client_hwm)
        request = two.begin(w, r, a)
        if request is None:
            assert got is None
        else:
            conflict = two.check(request, client_hwm)
            if conflict is not None:
                two.release(request)
                assert got == conflict
            else:
                assert isinstance(got, LockRequest)
                assert (got.checked, got.updated) == (request.checked, request.updated)
                held.append((got, request))
        assert one.busy_slots() == two.busy_slots()
        if held and fate != "hold":
            first, second = held.pop(0)
            if fate == "commit":
                txn += 1
                one.commit_and_release(first, txn)
                two.commit_and_release(second, txn)
            else:
                one.release(first)
                two.release(second)
        for lock in [*write, *read, *append, 0, 1]:
            assert one.lock_high_water_mark(lock) == two.lock_high_water_mark(lock)


def test_one_write_lock_requests_take_the_slots_of_their_lock_remembered_or_not() -> None:
    # begin_checked remembers the slots of recent lock values (bounded): whether remembered, computed
    # again after the memory was cleared, or new, a request holds exactly lock_slots(lock, size).
    from waltz.server import locks as locks_module

    table = LockTable(1000, -1)
    limit = locks_module._SLOTS_CACHE_ENTRIES
    values = [7, -7, 2**31 - 1, -(2**31), 7, *range(100, 100 + limit + 10), 7, -7]
    for lock in values:
        request = table.begin_checked((lock,), (), (), 5)
        assert isinstance(request, LockRequest)
        assert request.updated == lock_slots(lock, 1000)
        assert request.checked == (lock_slots(lock, 1000),)
        table.commit_and_release(request, 5)
        assert len(table._slots_of) <= limit


def test_the_remembered_slots_are_shared_by_tables_of_one_size() -> None:
    # One memory per server, not per partition: 1,000 partitions must not hold 1,000 of them.
    one, two, other = LockTable(777, -1), LockTable(777, -1), LockTable(778, -1)
    assert one._slots_of is two._slots_of
    assert other._slots_of is not one._slots_of
    request = one.begin_checked((123,), (), (), 5)
    assert isinstance(request, LockRequest)
    assert two._slots_of[123] == lock_slots(123, 777)
    request = other.begin_checked((123,), (), (), 5)
    assert isinstance(request, LockRequest)
    assert request.updated == lock_slots(123, 778)


def test_slots_take_memory_only_from_the_first_request_with_locks() -> None:
    # A partition whose appends never lock must not pay 9 bytes a slot (264 KiB at the default size): with
    # many partitions that was most of what one more partition cost a server.
    table = LockTable(initial_high_water_mark=7)
    assert not table.allocated
    assert len(table._hwms) == 0
    assert len(table._busy) == 0
    assert table.busy_slots() == 0
    assert table.lock_high_water_mark(L) == 7  # what every slot will start at
    request = table.begin_checked((L,), (), (), 7)
    assert isinstance(request, LockRequest)
    assert table.allocated
    assert len(table._hwms) == DEFAULT_LOCK_TABLE_SIZE
    assert set(table._hwms) == {7}
    table.commit_and_release(request, 8)
    assert table.lock_high_water_mark(L) == 8


@pytest.mark.parametrize("path", ["begin", "begin_checked"])
def test_an_unallocated_table_conflicts_as_an_allocated_one(path: str) -> None:
    # The first request sees every slot at the initial mark, whichever entry point allocates them.
    table = LockTable(initial_high_water_mark=20)
    if path == "begin":
        request = table.begin((L,), (M,), ())
        assert request is not None
        assert table.check(request, 19) == 20
    else:
        assert table.begin_checked((L,), (), (), 19) == 20
    assert table.allocated
