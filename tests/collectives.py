"""Collective counts as they run, for tests that pin them: with the planner as DTensor's redistribution engine
(`install(planner=True)`, DTENSOR_EXT_PLANNER=1) each data-moving step runs as one all_to_all_single carrying
exactly the plan's bytes where torch issues an all_gather_into_tensor; reductions keep torch's collectives."""

from dtensor_ext.redistribute import engine


def as_run(counts: dict[str, int]) -> dict[str, int]:
    """`counts` (torch's own collectives by name) as the running redistribution issues them."""
    if not engine.is_enabled():
        return counts
    out: dict[str, int] = {}
    for name, n in counts.items():
        name = "all_to_all_single" if name == "all_gather_into_tensor" else name
        out[name] = out.get(name, 0) + n
    return out
