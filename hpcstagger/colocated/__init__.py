"""The co-located run: several training jobs in one MPI world on one node, started with a stagger.

- :mod:`~hpcstagger.spec.jobspec`: the job spec (TOML) and its validation;
- :mod:`~hpcstagger.spec.runenv`: the environment variables the launcher passes to the ranks;
- :mod:`.coordinator`: :func:`init` on every rank (identity, rendezvous, plan, wait, backend);
- :mod:`~hpcstagger.stagger.delays`: the delays for a plan mode and the model's predictions (pure);
- :mod:`.launch`: ``hpcstagger launch``, ``status`` and ``exec``, and the results from status files;
- :mod:`~hpcstagger.measure.spec_calibration`: ``hpcstagger calibrate --spec``, each job measured from its own command;
- :mod:`~hpcstagger.colocated.jobmeter`: calibration mode inside a job (``session.loader``) and its reports;
- :mod:`.batch`: the sbatch script of a spec (pure rendering).

``hpcstagger.init`` and ``hpcstagger.Spec`` are the usual way in. This package exports those, the
job spec's :class:`JobSpec`, and :func:`launch` with its :class:`RunResult` and :class:`JobResult`
(``hpcstagger.colocated.launch`` is the function; ``importlib.import_module`` gives the module).
"""

from __future__ import annotations

from hpcstagger._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "Spec": "hpcstagger.spec.jobspec",
    "JobSpec": "hpcstagger.spec.jobspec",
    "init": "hpcstagger.colocated.coordinator",
    "Session": "hpcstagger.colocated.coordinator",
    "launch": "hpcstagger.colocated.launch",
    "RunResult": "hpcstagger.colocated.launch",
    "JobResult": "hpcstagger.colocated.launch",
}
# Internals of the launcher and the planner, exported for one release: name -> (target, warning).
_DEPRECATED: dict[str, tuple[str, str]] = {
    name: (module, f"hpcstagger.colocated.{name} is deprecated; use {module}.{name}")
    for name, module in (("PLAN_MODES", "hpcstagger.spec.jobspec"), ("resolve_job", "hpcstagger.spec.identity"),
                         ("plan_delays", "hpcstagger.stagger.delays"),
                         ("collect_results", "hpcstagger.colocated.launch"),
                         ("render_batch", "hpcstagger.colocated.batch"))
}

__all__ = ["Spec", "JobSpec", "init", "Session", "launch", "RunResult", "JobResult"]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals(), _DEPRECATED)
