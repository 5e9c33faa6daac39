import pytest

import dtensor_ext


@pytest.fixture
def installed():
    """The package's rules registered with DTensor (as `import dtensor_ext` leaves them)."""
    return dtensor_ext.install()


def pytest_terminal_summary(terminalreporter):
    from tests.rules.proof import TALLY

    if not TALLY:
        return
    terminalreporter.section("rule proofs (checker)")
    for op, (samples, combos, seconds) in sorted(TALLY.items()):
        terminalreporter.write_line(f"{op}: {samples} samples, {combos} combinations proven, {seconds:.1f}s")
