"""A session-wide local Slurm for the `slurm` tests; started only when they run."""
import os

import pytest

from tests.slurm.cluster import INSTALL_HINT, LocalSlurm, missing_binaries


def running_in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    missing = missing_binaries()
    if missing:
        problem = f"Slurm/munge binaries missing ({', '.join(missing)}); install them: {INSTALL_HINT}"
    elif os.geteuid() != 0:
        problem = "starting munged, slurmctld and slurmd for a local cluster needs root"
    else:
        problem = None
    if problem and running_in_ci():
        pytest.fail(f"CI must run the Slurm tests, but {problem}", pytrace=False)
    if problem:
        pytest.skip(problem)
    cluster = LocalSlurm(tmp_path_factory.mktemp("slurm")).start()
    yield cluster
    cluster.stop()
