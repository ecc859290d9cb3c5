import pytest

from cluster import Cluster


@pytest.fixture(scope="session", params=[2, 3], ids=lambda p: f"P{p}")
def cluster(request):
    """A long-lived pool of 2 or 3 gloo ranks shared by the tests that keep it healthy."""
    c = Cluster(request.param)
    yield c
    c.close()


@pytest.fixture
def fresh_cluster(request):
    """A cluster of 2 ranks that a test may break (dead peer, injected failure)."""
    c = Cluster(2)
    yield c
    c.close()
