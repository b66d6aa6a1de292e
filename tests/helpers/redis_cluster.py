"""The real Redis Cluster test bed (``pipeline.queue.local_cluster``, re-exported here for the tests that import it
from this module) and its fixtures: ``redis_cluster`` (3 primaries) and ``redis_cluster_replicas`` (3 primaries,
each with a replica), module-scoped; a test module takes the one it uses by name::

    redis_cluster = tests.helpers.redis_cluster.redis_cluster
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pipeline.queue.local_cluster import NODE_TIMEOUT_MS, LocalCluster, Node, cluster_binaries

__all__ = ["NODE_TIMEOUT_MS", "LocalCluster", "Node", "cluster_binaries", "redis_cluster", "redis_cluster_replicas",
           "running_cluster"]


def running_cluster(**kwargs: object) -> Iterator[LocalCluster]:
    """A started cluster for a fixture to yield; skips the test where Redis 7's binaries are missing."""
    if cluster_binaries() is None:
        pytest.skip("needs redis-server and redis-cli of Redis 7 or later on PATH (apt-get install redis-server)")
    with LocalCluster(**kwargs) as cluster:  # type: ignore[arg-type]
        yield cluster


@pytest.fixture(scope="module")
def redis_cluster() -> Iterator[LocalCluster]:
    """Three primaries, no replicas."""
    yield from running_cluster(masters=3, replicas=0)


@pytest.fixture(scope="module")
def redis_cluster_replicas() -> Iterator[LocalCluster]:
    """Three primaries, each with one replica (for failovers)."""
    yield from running_cluster(masters=3, replicas=1)
