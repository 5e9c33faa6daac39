import os

import pytest
import torch

from dtensor_ext.testing.strategies import load_profile

pytest_plugins = ["dtensor_ext.testing.fixtures"]

load_profile()

# Simulated ranks run ops on tiny per-rank pieces thousands of times; with intra-op threads on a shared 2-core box
# (CI runs two suites at once) a pad or pooling kernel call costs ~8-20 ms of thread hand-off instead of ~10 us.
# Set here, not per directory: a run of any part of the suite (the older-torch tier) runs as the whole suite does.
torch.set_num_threads(1)


# --- DTENSOR_EXT_PLANNER=1 (the suite with the planner as DTensor's redistribution engine) ---
@pytest.fixture(autouse=True)
def _planner_on_in_every_test():
    """With DTENSOR_EXT_PLANNER=1 every test starts with the planner on: a test before it that compared with torch
    alone (dtensor_ext.uninstall(), engine.disable()) must not leave the rest of the run without it."""
    if os.environ.get("DTENSOR_EXT_PLANNER") == "1":
        from dtensor_ext.redistribute import engine

        if not engine.is_enabled():
            engine.enable()
    yield
