import pytest

import dtensor_ext


@pytest.fixture
def installed():
    """The package's rules registered with DTensor (as `import dtensor_ext` leaves them)."""
    return dtensor_ext.install()
