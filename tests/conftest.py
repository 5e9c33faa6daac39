from dtensor_ext.testing.strategies import load_profile

pytest_plugins = ["dtensor_ext.testing.fixtures"]

load_profile()
