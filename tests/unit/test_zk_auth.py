"""ZooKeeper digest credentials and ACLs (``waltz.cluster.zk.ZkAuth``) and the storage peer allow-list."""

from __future__ import annotations

from pathlib import Path

import pytest
from kazoo.security import Permissions

from waltz.cluster.zk import ZkAuth, digest_id, read_auth_file
from waltz.errors import ConfigError
from waltz.storage.config import StorageConfig
from waltz.tls import parse_peer_names, peer_common_name


def test_digest_id_matches_zookeepers_own() -> None:
    # Computed by ZooKeeper 3.8's DigestAuthenticationProvider for "waltz:secret".
    assert digest_id("waltz:secret") == "waltz:PWd3wMZXs87DOKqOzHvSfX0/vxw="


def test_anonymous_by_default() -> None:
    auth = ZkAuth.from_config({})
    assert not auth.enabled
    assert auth.auth_data() is None
    assert auth.default_acl() is None


def test_identity_and_readers_make_the_acl(tmp_path: Path) -> None:
    f = tmp_path / "zk.auth"
    f.write_text("waltz:secret\n")
    reader = digest_id("app:pw")
    auth = ZkAuth.from_config({"zookeeper.authFile": str(f), "zookeeper.aclReaders": f" {reader} ,"})
    assert auth.auth_data() == [("digest", "waltz:secret")]
    acl = auth.default_acl()
    assert acl is not None
    # Named, not ZooKeeper's "auth" scheme: over TLS that would also grant the creator's x509 certificate id.
    assert (acl[0].id.scheme, acl[0].id.id, acl[0].perms) == (
        "digest",
        digest_id("waltz:secret"),
        Permissions.ALL,
    )
    assert (acl[1].id.scheme, acl[1].id.id, acl[1].perms) == ("digest", reader, Permissions.READ)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("no-colon", "one line user:password"),
        (":pw", "one line"),
        ("a:b\nc:d", "one line"),
        ("x" * 5000, "too long"),
    ],
)
def test_bad_auth_files_are_refused(tmp_path: Path, content: str, message: str) -> None:
    f = tmp_path / "zk.auth"
    f.write_text(content)
    with pytest.raises(ConfigError, match=message):
        read_auth_file(str(f))


def test_readers_need_an_identity_and_the_digest_form(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"needs zookeeper\.authFile"):
        ZkAuth.from_config({"zookeeper.aclReaders": digest_id("app:pw")})
    f = tmp_path / "zk.auth"
    f.write_text("waltz:secret")
    with pytest.raises(ConfigError, match="not a digest id"):
        ZkAuth.from_config({"zookeeper.authFile": str(f), "zookeeper.aclReaders": "justaname"})
    with pytest.raises(ConfigError, match="cannot read"):
        ZkAuth.from_config({"zookeeper.authFile": str(tmp_path / "missing")})


def test_peer_names() -> None:
    assert parse_peer_names("waltz server, waltz admin,,") == ("waltz server", "waltz admin")
    cert = {"subject": ((("countryName", "NL"),), (("commonName", "waltz server"),))}
    assert peer_common_name(cert) == "waltz server"
    assert peer_common_name({}) is None
    assert peer_common_name(None) is None


def test_allowed_peers_need_client_certificates(tmp_path: Path) -> None:
    base = {
        "storage.port": 0,
        "storage.admin.port": 0,
        "storage.directory": str(tmp_path),
        "storage.cluster.key": "6f1f0f7e-1d2c-4b3a-9e8d-7c6b5a493827",
        "storage.cluster.numPartitions": 1,
    }
    with pytest.raises(ConfigError, match=r"allowedPeers needs storage\.ssl\.caFile"):
        StorageConfig.from_mapping({**base, "storage.ssl.allowedPeers": "waltz server"})
    assert StorageConfig.from_mapping(base).allowed_peers == ()
