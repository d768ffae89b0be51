import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_cpu_thread():
    # The tiny models run many small matmuls; on a shared, loaded machine intra-op threads spin
    # against each other and make them ~50x slower.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
