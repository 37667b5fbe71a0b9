"""Two hosts on this machine (scripts/testcluster/multinode-up.sh: network namespaces node1/node2 on a
private bridge, nothing leaves the machine) and, for the Slurm tests, a 2-node Slurm on them. Root only;
skipped with the reason elsewhere; what this session created is removed at its end."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.slurm.cluster import Up, cluster, reference_summary


@pytest.fixture(scope="session")
def network() -> Iterator[Up]:
    yield from cluster("multinode-up.sh", "multinode-down.sh", ("--network-only",), ("--network-only",))


@pytest.fixture(scope="session")
def slurm2(network: Up) -> Iterator[Up]:
    yield from cluster("multinode-up.sh", "multinode-down.sh", (), ("--slurm-only",))


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    return reference_summary(Path(tmp_path_factory.getbasetemp()))
