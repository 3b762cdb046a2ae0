"""Settings for the sanitizer tests."""
import os

import pytest


@pytest.fixture(scope="module", autouse=True)
def strict_barriers():
    """Threads that return before a barrier must be reported (barrier_divergence): the
    lenient mode, TSM_EMU_EXITED_THREADS_ARRIVE=1, is read once per loaded library, when it
    first meets a barrier, so it stays off for the whole module. The test of the lenient mode
    sets it for a source of its own."""
    saved = os.environ.pop("TSM_EMU_EXITED_THREADS_ARRIVE", None)
    yield
    if saved is not None:
        os.environ["TSM_EMU_EXITED_THREADS_ARRIVE"] = saved
