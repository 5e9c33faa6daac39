import pytest

import dtensor_ext


@pytest.fixture(params=["torch only", "fixed"])
def fix_state(request):
    """Run a test with the package's rules but none of its torch fixes, and with them (the default)."""
    dtensor_ext.install(fix_torch=request.param == "fixed")
    yield request.param
    dtensor_ext.install()


@pytest.fixture
def torch_only():
    dtensor_ext.install(fix_torch=False)
    yield
    dtensor_ext.install()
