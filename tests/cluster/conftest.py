"""The test node (node_cluster.py) for tests/cluster: started once per session, stopped after
the folder's last test, also when a test fails; and the operator as users install it (`helm
install` of the chart with the locally built image), once per module that asks for it.

Skips when the node cannot run here (not root, or scripts/k8s_env.sh has not built it); with
``DISAGGPOOL_REQUIRE_CLUSTER=1`` (what .ci/run sets) it fails instead, naming what is missing.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import node_cluster
from images import PROJECT

REPO = Path(__file__).resolve().parents[2]

#: Starting the node builds and imports the images: minutes on two busy cores.
CLUSTER_TIMEOUT_S = 900


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in item.path.parents:
            item.add_marker(pytest.mark.timeout(CLUSTER_TIMEOUT_S))


_node_key = pytest.StashKey[contextlib.ExitStack]()


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Stop the node once the folder's last test is done: an idle control plane and kubelet keep
    the cores busy, which would slow every timing-sensitive test that runs after this folder."""
    here = Path(__file__).parent
    if here not in item.path.parents or (nextitem is not None and here in nextitem.path.parents):
        return
    stack = item.config.stash.get(_node_key, None)
    if stack is not None:
        stack.close()


@pytest.fixture(scope="session")
def node(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[node_cluster.NodeCluster]:
    why = node_cluster.unavailable()
    if why:
        if os.environ.get(node_cluster.REQUIRE_ENV) == "1":
            pytest.fail(f"{node_cluster.REQUIRE_ENV}=1 but {why}", pytrace=False)
        pytest.skip(why)
    with contextlib.ExitStack() as stack:
        request.config.stash[_node_key] = stack
        yield stack.enter_context(node_cluster.running_node(tmp_path_factory.mktemp("node")))


@pytest.fixture(scope="module")
def operator(node: node_cluster.NodeCluster) -> Iterator[dict[str, Any]]:
    """The chart installed as release `dp`: the operator's Deployment, rolled out."""
    ns = node_cluster.OPERATOR_NAMESPACE
    node.helm(
        "install", "dp", str(REPO / "helm" / "disaggpool"), "--namespace", ns,
        "--create-namespace",
        "--set", f"image.repository={PROJECT[0]}",
        "--set", f"image.tag={PROJECT[1]}",
        "--set", "image.pullPolicy=Never",
        "--set", "operator.resyncSeconds=5",
    )  # fmt: skip
    (deployment,) = node.get("deployments", "-n", ns)["items"]
    name = deployment["metadata"]["name"]
    node.kubectl("rollout", "status", "-n", ns, f"deployment/{name}", "--timeout=240s")
    yield deployment
    node.helm("uninstall", "dp", "--namespace", ns, "--wait", check=False)
