"""The dotted-key YAML config loader."""

import re
from pathlib import Path

import pytest

from waltz.config import ConfigSchema, Key, distinct_ports, host_port, parse_partition_ranges
from waltz.errors import ConfigError

SCHEMA = ConfigSchema(
    [
        Key("storage.port", int, min_value=1, max_value=65535),
        Key("storage.directory", str),
        Key("storage.segment.size.threshold", int, 1_000_000_000, min_value=1024),
        Key("storage.fsync", bool, True),
    ]
)


def test_flat_and_nested_keys_are_the_same(tmp_path: Path) -> None:
    f = tmp_path / "s.yaml"
    f.write_text("storage:\n  port: 5000\n  segment:\n    size.threshold: 2048\nstorage.directory: /d\n")
    cfg = SCHEMA.load(f)
    assert cfg == {
        "storage.port": 5000,
        "storage.directory": "/d",
        "storage.segment.size.threshold": 2048,
        "storage.fsync": True,
    }


def test_all_problems_reported_with_suggestion() -> None:
    with pytest.raises(ConfigError) as e:
        SCHEMA.parse(
            {"storage.prot": 1, "storage.segment.size.threshold": 5, "storage.fsync": "maybe"}, "x.yaml"
        )
    text = str(e.value)
    assert "x.yaml" in text
    assert "did you mean 'storage.port'" in text
    assert "at least 1024" in text
    assert "true or false" in text
    assert "storage.directory: required" in text


def test_missing_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        SCHEMA.load(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [1,\n")
    with pytest.raises(ConfigError, match=r"not valid YAML at line 2, column 1") as e:
        SCHEMA.load(bad)
    assert "\n" not in str(e.value)  # one line, as every CLI error
    lst = tmp_path / "list.yaml"
    lst.write_text("- 1\n")
    with pytest.raises(ConfigError, match="mapping"):
        SCHEMA.load(lst)


def test_distinct_ports() -> None:
    distinct_ports({"a": 1, "b": 2, "c": 0, "d": 0}, ["a", "b", "c", "d"])
    with pytest.raises(ConfigError, match="distinct"):
        distinct_ports({"a": 1, "b": 1}, ["a", "b"])


def test_partition_ranges() -> None:
    assert parse_partition_ranges("0-3,7, 2") == [0, 1, 2, 3, 7]
    for bad in ["", "a", "3-1", "-1", "1-x"]:
        with pytest.raises(ConfigError):
            parse_partition_ranges(bad)
    with pytest.raises(ConfigError, match="out of range"):
        parse_partition_ranges("0-8", num_partitions=8)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("127.0.0.1:80", ("127.0.0.1", 80)),
        ("storage-1.example.com:65535", ("storage-1.example.com", 65535)),
        ("  host:1 ", ("host", 1)),
        ("[::1]:9000", ("::1", 9000)),
        ("[fe80::1%eth0]:2181", ("fe80::1%eth0", 2181)),
    ],
)
def test_host_port_takes_names_ipv4_and_bracketed_ipv6(text: str, expected: tuple[str, int]) -> None:
    assert host_port(text) == expected


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("", "expected host:port"),
        ("x", "no port given"),
        (":1", "expected host:port"),
        ("h:", "from 1 to 65535"),
        ("h:0", "from 1 to 65535"),
        ("h:65536", "from 1 to 65535"),
        ("h:p", "from 1 to 65535"),
        ("h:-1", "from 1 to 65535"),
        ("h:+80", "from 1 to 65535"),
        ("h:8_0", "from 1 to 65535"),
        ("h:\u0668\u0660", "from 1 to 65535"),  # Arabic-Indic digits: isdigit() but not a port
        ("::1:9000", "needs brackets"),
        ("[::1]9000", "':port' after the bracketed address"),
        ("[::1:9000", "expected \\[IPv6 address\\]:port"),
        ("[]:9000", "expected \\[IPv6 address\\]:port"),
        ("[::1]:", "from 1 to 65535"),
    ],
)
def test_host_port_refuses_bad_input_naming_what_and_why(text: str, reason: str) -> None:
    with pytest.raises(ConfigError, match=f"bad storage address {re.escape(repr(text))}: .*{reason}"):
        host_port(text, what="storage address")


def test_host_port_default_port_is_only_for_a_text_without_one() -> None:
    assert host_port("zk1", default_port=2181) == ("zk1", 2181)
    assert host_port("[::1]", default_port=2181) == ("::1", 2181)
    assert host_port("zk1:2182", default_port=2181) == ("zk1", 2182)
    with pytest.raises(ConfigError):
        host_port("zk1:0", default_port=2181)
