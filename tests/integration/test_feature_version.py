"""The cluster's feature version with real processes: ``waltz cluster features`` and ``raise-features``, a
raise refused while a process could not follow, and processes that refuse to start in a cluster whose feature
version they do not support."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from kazoo.client import KazooClient

from tests.integration.conftest import ClusterFactory
from tests.integration.server_process import ServerProcess, ServerProcessError
from tests.integration.storage_process import StorageProcess, StorageProcessError
from waltz.cli.main import main
from waltz.cluster import features as ft
from waltz.cluster.server_descriptor import ServerDescriptor
from waltz.cluster.zk import ClusterPaths
from waltz.version import __version__

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

ROOT = "/cluster"


def _cli_config(tmp_path: Path, connect_string: str) -> str:
    path = tmp_path / "cli.yaml"
    path.write_text(
        f"zookeeper:\n  connectString: {connect_string}\n  sessionTimeout: 4000\n  connectTimeout: 1500\n"
        f"cluster.root: {ROOT}\n",
        encoding="utf-8",
    )
    return str(path)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as e:
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_features_shown_raised_once_and_never_lowered(
    cluster_factory: ClusterFactory,
    tmp_path: Path,
    zk_connect_string: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    cluster = cluster_factory(num_partitions=1, feature_version=1)
    asyncio.run(cluster.start(storages=2, servers=1))
    cfg = _cli_config(tmp_path, zk_connect_string)

    code, out, _ = run(capsys, "cluster", "features", "-c", cfg)
    assert code == 0
    assert "feature version: 1 (Waltz 0.1.0" in out
    assert out.count(f"Waltz {__version__}, features 1-3") == 3, out  # two storage nodes, one server
    assert "can raise to 2" in out
    assert out.rstrip().endswith(": yes")

    code, out, _ = run(capsys, "cluster", "raise-features", "-c", cfg, "--to", "2")
    assert (code, out.strip()) == (0, "feature version raised from 1 to 2")
    code, out, _ = run(capsys, "cluster", "raise-features", "-c", cfg)
    assert (code, out.strip()) == (0, "feature version raised from 2 to 3")
    code, out, _ = run(capsys, "cluster", "raise-features", "-c", cfg)
    assert (code, out.strip()) == (0, "feature version already 3: nothing to do")
    code, _, err = run(capsys, "cluster", "raise-features", "-c", cfg, "--to", "1")
    assert code != 0
    assert "it is never lowered" in err
    code, _, err = run(capsys, "cluster", "raise-features", "-c", cfg, "--to", "4")
    assert code != 0
    assert "feature version 4 is not one this Waltz knows" in err
    code, out, _ = run(capsys, "cluster", "features", "-c", cfg)
    assert "feature version: 3 (Waltz 0.2.0" in out
    # A restarted server still starts: it supports 3.
    asyncio.run(asyncio.to_thread(cluster.servers[0].restart))


def test_a_raise_is_refused_while_a_process_could_not_follow(
    cluster_factory: ClusterFactory,
    tmp_path: Path,
    zk: KazooClient,
    zk_connect_string: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    cluster = cluster_factory(num_partitions=1, feature_version=1)
    asyncio.run(cluster.start(storages=2, servers=1))
    cfg = _cli_config(tmp_path, zk_connect_string)
    paths = ClusterPaths(ROOT)

    # A server of Waltz 0.1.0: a descriptor, and no feature registration beside it.
    old = zk.create(
        paths.server_descriptor_prefix,
        ServerDescriptor(99, "127.0.0.1", 1).encode(),
        ephemeral=True,
        sequence=True,
    )
    code, _, err = run(capsys, "cluster", "raise-features", "-c", cfg)
    assert code != 0
    assert "cannot raise the feature version from 1 to 3" in err
    assert "server 99 (127.0.0.1:1): Waltz 0.1.0, features 1: no feature registration" in err
    zk.delete(old)

    # A storage node that is down might come back on an older release: refused too, naming it.
    stopped = cluster.storages[1]
    stopped.terminate()
    code, _, err = run(capsys, "cluster", "raise-features", "-c", cfg)
    assert code != 0
    assert f"storage 127.0.0.1:{stopped.port}: Waltz ?, features unknown: admin port" in err
    assert "unreachable" in err
    assert ft.read_feature_version(zk, ROOT) == (1, -1)  # nothing was written

    stopped.restart()
    code, out, _ = run(capsys, "cluster", "raise-features", "-c", cfg)
    assert (code, out.strip()) == (0, "feature version raised from 1 to 3")

    # A 0.1.0 server started after the raise cannot check the feature version itself: `features` flags it.
    zk.create(
        paths.server_descriptor_prefix,
        ServerDescriptor(98, "127.0.0.1", 2).encode(),
        ephemeral=True,
        sequence=True,
    )
    code, out, _ = run(capsys, "cluster", "features", "-c", cfg)
    assert code == 1
    assert "PROBLEM: server 98 (127.0.0.1:2) does not support feature version 3 (it supports 1)" in out


def test_processes_refuse_a_feature_version_they_do_not_support(
    cluster_factory: ClusterFactory, tmp_path: Path, zk: KazooClient, zk_connect_string: str
) -> None:
    cluster_factory(num_partitions=1, feature_version=1)  # creates the cluster at ROOT
    ft.write_feature_version(zk, ROOT, ft.SUPPORTED_FEATURES.hi + 1, -1)
    want = (
        f"the cluster's feature version is {ft.SUPPORTED_FEATURES.hi + 1} ({ROOT}/features), but Waltz "
        f"{__version__} supports feature versions {ft.SUPPORTED_FEATURES}"
    )
    storage = StorageProcess(
        tmp_path,
        use_cluster_identity=False,
        config={"zookeeper.connectString": zk_connect_string, "cluster.root": ROOT},
    )
    with pytest.raises(StorageProcessError, match="exited before serving") as e:
        storage.start()
    assert f"this storage node: {want}" in str(e.value)
    server = ServerProcess(tmp_path, zk_connect=zk_connect_string, cluster_root=ROOT)
    with pytest.raises(ServerProcessError, match="exited before serving") as e2:
        server.start()
    assert f"this server: {want}" in str(e2.value)
    assert zk.get_children(ClusterPaths(ROOT).server_descriptors) == []
