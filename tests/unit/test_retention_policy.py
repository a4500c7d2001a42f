"""The retention policy (``<root>/store/retention``): golden bytes, strict decoding, the policy's target, and
bad input refused with a message that names the value."""

from __future__ import annotations

import pytest

from waltz.cli.main import main as waltz_main
from waltz.cluster.retention import (
    DEFAULT_GRACE_MS,
    RetentionConfig,
    decode_or_default,
    policy_trim_point,
    retention_refusal,
)
from waltz.errors import MetadataError


def test_golden_bytes_and_round_trip() -> None:
    config = RetentionConfig(60_000, 1_000, {5: 10, 2: 0})
    raw = config.encode()
    assert raw.hex() == (
        "01" + "000000000000ea60" + "00000000000003e8" + "00000002"
        + "00000002" + "0000000000000000" + "00000005" + "000000000000000a"
    )  # fmt: skip
    assert RetentionConfig.decode(raw) == config
    assert (config.keep_transactions_of(5), config.keep_transactions_of(2)) == (10, 0)
    assert config.keep_transactions_of(1) == 1_000


def test_no_policy_keeps_everything_with_an_hour_of_grace() -> None:
    default = decode_or_default(None)
    assert (default.grace_ms, default.keep_transactions, dict(default.overrides)) == (DEFAULT_GRACE_MS, 0, {})
    assert DEFAULT_GRACE_MS == 3_600_000
    assert policy_trim_point(default.keep_transactions_of(0), 1_000_000) == 0


@pytest.mark.parametrize(
    "hex_",
    [
        "02" + "00" * 20,  # unknown version
        "01" + "ffffffffffffffff" + "0000000000000000" + "00000000",  # negative grace
        "01" + "0000000000000000" + "ffffffffffffffff" + "00000000",  # negative keep
        "01" + "0000000000000000" + "0000000000000000" + "00000002"
        + ("00000001" + "0000000000000005") * 2,  # a partition twice
        "01" + "0000000000000000" + "0000000000000000" + "0000000100",  # truncated
    ],
)  # fmt: skip
def test_bad_values_are_refused(hex_: str) -> None:
    with pytest.raises(MetadataError):
        RetentionConfig.decode(bytes.fromhex(hex_))


def test_the_policy_target_never_passes_the_high_water_mark() -> None:
    assert policy_trim_point(1_000, 9_999) == 9_000  # ids 9000..9999 kept
    assert policy_trim_point(1_000, 500) == 0  # fewer than N written: nothing to trim
    assert policy_trim_point(1, 9_999) == 9_999  # the last committed transaction is always kept
    assert policy_trim_point(0, 9_999) == 0  # no policy


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((None, 0, None, False, False), "the default: --keep-transactions 0 would trim everything"),
        ((3, -5, None, False, False), "partition 3: --keep-transactions -5 would trim everything"),
        ((None, None, None, False, False), "nothing to change"),
        ((3, None, 1000, False, False), "the grace (--grace-ms) is cluster-wide"),
        ((None, None, -1, False, False), "--grace-ms -1 is outside 0..2592000000"),
        ((None, None, 10**12, False, False), "the unit is milliseconds"),
        ((None, 5, None, True, False), "give at most one of"),
        ((-1, 5, None, False, False), "partition -1 does not exist"),
    ],
)
def test_bad_policy_edits_are_refused_naming_the_value(
    args: tuple[int | None, int | None, int | None, bool, bool], message: str
) -> None:
    assert message in (retention_refusal(*args) or "")


def test_good_edits_pass() -> None:
    assert retention_refusal(None, 1_000, 60_000) is None
    assert retention_refusal(2, None, None, keep_all=True) is None
    assert retention_refusal(2, None, None, clear=True) is None


def test_the_cli_refuses_bad_arguments_before_touching_zookeeper(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        waltz_main(["cluster", "retention", "set", "-c", "/nonexistent.yaml", "--grace-ms", "-1"])
    assert exit_.value.code == 2
    assert "--grace-ms: must not be negative, got -1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        waltz_main(["cluster", "retention", "set", "-c", "x", "--keep-transactions", "5", "--keep-all"])
    assert "not allowed with argument" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        waltz_main(["cluster", "trim", "-c", "x", "-p", "0", "--to", "5", "--cancel"])
    assert "not allowed with argument" in capsys.readouterr().err
