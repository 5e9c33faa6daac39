import pytest
import torch

import dtensor_ext

# The checker runs ops on tiny per-rank pieces thousands of times; with intra-op threads on a shared 2-core box
# each pad kernel call costs ~20 ms of thread hand-off instead of ~5 us.
torch.set_num_threads(1)


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
