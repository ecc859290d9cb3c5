import os

import pytest
from hypothesis import settings

from cluster import Cluster

# CI draws the same examples on every run of a commit (derandomized, no example database), so a
# commit that changed nothing cannot fail by chance; HYPOTHESIS_PROFILE=explore draws new ones.
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session", params=[2, pytest.param(3, marks=pytest.mark.slow)], ids=lambda p: f"P{p}")
def cluster(request):
    """A long-lived pool of 2 or 3 gloo ranks shared by the tests that keep it healthy (the 3-rank runs
    are in the full suite only: the fast tier runs every cluster test at 2 ranks)."""
    c = Cluster(request.param)
    yield c
    c.close()


@pytest.fixture
def fresh_cluster(request):
    """A cluster of 2 ranks that a test may break (dead peer, injected failure): not waited for long at
    the end."""
    c = Cluster(2)
    yield c
    c.close(grace_s=1.0)
