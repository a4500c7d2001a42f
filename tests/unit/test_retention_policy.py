"""The retention policy (``<root>/store/retention``): golden bytes, strict decoding, the policy's target, and
bad input refused with a message that names the value."""

from __future__ import annotations

import pytest

from waltz.cli.main import main as waltz_main
from waltz.cluster.retention import (
    DEFAULT_GRACE_MS,
    Limits,
    RetentionConfig,
    RetentionEdit,
    decode_or_default,
    policy_trim_point,
)
from waltz.errors import MetadataError


def test_golden_bytes_and_round_trip() -> None:
    config = RetentionConfig(60_000, Limits(1_000, 0), {5: Limits(10, 0), 2: Limits(0, 1 << 30)})
    raw = config.encode()
    assert raw.hex() == (
        "01" + "000000000000ea60" + "00000000000003e8" + "0000000000000000" + "00000002"
        + "00000002" + "0000000000000000" + "0000000040000000"
        + "00000005" + "000000000000000a" + "0000000000000000"
    )  # fmt: skip
    assert RetentionConfig.decode(raw) == config
    assert config.limits_of(5) == Limits(10, 0)
    assert config.limits_of(1) == Limits(1_000, 0)  # no override: the default
    assert config.describe(4) == [
        "grace: 60000 ms (retention.graceMs)",
        "default: keep the last 1000 transactions",
        "partition 2: keep the newest segments holding 1073741824 bytes",
        "partition 5: keep the last 10 transactions (no such partition)",
    ]


def test_no_policy_keeps_everything_with_an_hour_of_grace() -> None:
    default = decode_or_default(None)
    assert (default.grace_ms, default.default, dict(default.overrides)) == (DEFAULT_GRACE_MS, Limits(), {})
    assert DEFAULT_GRACE_MS == 3_600_000
    assert default.limits_of(0).keeps_everything
    assert policy_trim_point(default.limits_of(0), 1_000_000, [(0, 10**12)]) == 0


@pytest.mark.parametrize(
    "hex_",
    [
        "02" + "00" * 28,  # unknown version
        "01" + "ffffffffffffffff" + "00" * 16 + "00000000",  # negative grace
        "01" + "00" * 8 + "ffffffffffffffff" + "00" * 8 + "00000000",  # negative keep transactions
        "01" + "00" * 16 + "ffffffffffffffff" + "00000000",  # negative keep bytes
        "01" + "00" * 24 + "00000002" + ("00000001" + "00" * 16) * 2,  # a partition twice
        "01" + "00" * 24 + "0000000100",  # truncated
    ],
)  # fmt: skip
def test_bad_values_are_refused(hex_: str) -> None:
    with pytest.raises(MetadataError):
        RetentionConfig.decode(bytes.fromhex(hex_))


def test_the_policy_target_never_passes_the_high_water_mark() -> None:
    assert policy_trim_point(Limits(1_000), 9_999) == 9_000  # ids 9000..9999 kept
    assert policy_trim_point(Limits(1_000), 500) == 0  # fewer than N written: nothing to trim
    assert policy_trim_point(Limits(1), 9_999) == 9_999  # the last committed transaction is always kept
    assert policy_trim_point(Limits(), 9_999) == 0  # no policy


def test_a_limit_in_bytes_keeps_whole_segments() -> None:
    segments = [(0, 100), (10, 100), (20, 100), (30, 40)]  # oldest first; 30 is the writable one
    assert policy_trim_point(Limits(keep_bytes=140), 35, segments) == 20  # 20.. and 30.. hold 140
    assert policy_trim_point(Limits(keep_bytes=141), 35, segments) == 10
    assert policy_trim_point(Limits(keep_bytes=10**6), 35, segments) == 0  # fewer bytes than that: keep all
    assert policy_trim_point(Limits(keep_bytes=1), 35, segments) == 30
    assert policy_trim_point(Limits(keep_bytes=1), 29, segments) == 29  # never above the high-water mark
    # Both limits: the one that trims more.
    assert policy_trim_point(Limits(keep_transactions=30, keep_bytes=141), 35, segments) == 10
    assert policy_trim_point(Limits(keep_transactions=5, keep_bytes=141), 35, segments) == 31


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (RetentionEdit(keep_transactions=0), "the default: --keep-transactions 0 would trim everything"),
        (RetentionEdit(3, keep_transactions=-5), "partition 3: --keep-transactions -5 would trim everything"),
        (RetentionEdit(3, keep_bytes=0), "partition 3: --keep-bytes 0 would trim everything"),
        (RetentionEdit(), "nothing to change"),
        (RetentionEdit(3, grace_ms=1000), "the grace (--grace-ms) is cluster-wide"),
        (RetentionEdit(grace_ms=-1), "--grace-ms -1 is outside 0..2592000000"),
        (RetentionEdit(grace_ms=10**12), "the unit is milliseconds"),
        (RetentionEdit(keep_transactions=5, keep_all=True), "give only one of"),
        (RetentionEdit(keep_bytes=5, clear=True), "give only one of"),
        (RetentionEdit(-1, keep_transactions=5), "partition -1 does not exist"),
    ],
)
def test_bad_policy_edits_are_refused_naming_the_value(edit: RetentionEdit, message: str) -> None:
    assert message in (edit.refusal() or "")


def test_edits() -> None:
    config = RetentionConfig()
    config = RetentionEdit(keep_transactions=1_000, grace_ms=60_000).applied(config)
    assert (config.grace_ms, config.default) == (60_000, Limits(1_000, 0))
    config = RetentionEdit(keep_bytes=5_000).applied(config)  # the other limit stays
    assert config.default == Limits(1_000, 5_000)
    config = RetentionEdit(2, keep_all=True).applied(config)
    assert config.limits_of(2).keeps_everything
    config = RetentionEdit(3, keep_bytes=7).applied(config)  # an override replaces both limits
    assert config.limits_of(3) == Limits(0, 7)
    config = RetentionEdit(2, clear=True).applied(config)
    assert config.limits_of(2) == Limits(1_000, 5_000)
    config = RetentionEdit(clear=True).applied(config)
    assert (config.default, config.grace_ms, dict(config.overrides)) == (Limits(), 60_000, {3: Limits(0, 7)})
    for edit in (
        RetentionEdit(keep_transactions=1),
        RetentionEdit(3, keep_bytes=1),
        RetentionEdit(grace_ms=0),
    ):
        assert edit.refusal() is None


def test_the_cli_refuses_bad_arguments_before_touching_zookeeper(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        waltz_main(["cluster", "retention", "set", "-c", "/nonexistent.yaml", "--grace-ms", "-1"])
    assert exit_.value.code == 2
    assert "--grace-ms: must not be negative, got -1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        waltz_main(["cluster", "trim", "-c", "x", "-p", "0", "--to", "5", "--cancel"])
    assert "not allowed with argument" in capsys.readouterr().err
