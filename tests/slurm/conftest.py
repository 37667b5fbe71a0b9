"""A real single-node Slurm for the tests in this folder, brought up by the repository's own
scripts/testcluster/slurm-up.sh (root, Debian/Ubuntu: installs slurmctld + slurmd + munge when missing).
Skipped, with the reason in the summary, where the machine cannot host it; torn down at the end of the
session if this session started it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.slurm.cluster import Up, cluster


@pytest.fixture(scope="session")
def slurm() -> Iterator[Up]:
    yield from cluster("slurm-up.sh", "slurm-down.sh")

