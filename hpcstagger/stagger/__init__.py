"""Deciding the stagger of a co-located run: the plan before it, and the releases while it goes on.

- :mod:`.runplan`: :class:`RunPlan`, the plan's typed form, and :class:`PlanInputs`;
- :mod:`.delays`: :func:`plan_run`, the delays for a plan mode and the model's predictions;
- :mod:`.guard`: holding a plan's jobs until the run can show whether the plan was right;
- :mod:`.scenario_build`: a spec's scenario from what was measured (calibration, learning);
- :mod:`.steering`: when to release each waiting job, from what the run shows, and the release groups;
- :mod:`.history`: what earlier runs of a spec measured, as corrections for the next plan;
- :mod:`.learning`: a spec without a scenario, learned from its own runs;
- :mod:`.jobfields`: a job's measurement files as the scenario's job fields.

Nothing here starts a thread or talks to other ranks: the run (:mod:`hpcstagger.colocated`)
carries out what is decided here.
"""

from __future__ import annotations

from hpcstagger._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "RunPlan": "hpcstagger.stagger.runplan",
    "PlanInputs": "hpcstagger.stagger.runplan",
    "plan_run": "hpcstagger.stagger.delays",
}

__all__ = ["RunPlan", "PlanInputs", "plan_run"]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
