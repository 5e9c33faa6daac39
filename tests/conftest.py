import os

import pytest

from dtensor_ext.testing.strategies import load_profile

pytest_plugins = ["dtensor_ext.testing.fixtures"]

load_profile()


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
