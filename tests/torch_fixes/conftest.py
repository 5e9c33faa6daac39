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


@pytest.fixture(scope="session")
def fixed_ops():
    """torch fix name -> the ops the default install applies it to: those where its feature check found the defect
    in this torch. Tests expect torch alone to fail only there, and to be right elsewhere."""
    from dtensor_ext.torch_fixes import declared_fixes

    dtensor_ext.install()
    entries = [e for e in dtensor_ext.registry() if e.family == "torch fix"]
    return {
        fix.name: {e.op for e in entries if e.where == fix.where and e.status == "fixed"}
        for fix in declared_fixes().values()
    }
