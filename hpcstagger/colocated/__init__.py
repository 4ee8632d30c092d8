"""The co-located run: several training jobs in one MPI world on one node, started with a stagger.

- :mod:`.spec`: the job spec (TOML) and its validation;
- :mod:`.env`: the environment variables the launcher passes to the ranks;
- :mod:`.coordinator`: :func:`init` on every rank (identity, rendezvous, plan, wait, backend);
- :mod:`.planning`: the delays for a plan mode and the model's predictions (pure);
- :mod:`.launch`: ``hpcstagger launch``, ``status`` and ``exec``, and the results from status files;
- :mod:`.calibrate_spec`: ``hpcstagger calibrate --spec``, each job measured from its own command;
- :mod:`.calibration`: calibration mode inside a job (``session.loader``) and its reports;
- :mod:`.batch`: the sbatch script of a spec (pure rendering).

``hpcstagger.init`` and ``hpcstagger.Spec`` are the usual way in.
"""

from __future__ import annotations

from .._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "Spec": "spec",
    "JobSpec": "spec",
    "PLAN_MODES": "spec",
    "init": "coordinator",
    "Session": "coordinator",
    "resolve_job": "identity",
    "plan_delays": "planning",
    "launch": "launch",
    "collect_results": "launch",
    "RunResult": "launch",
    "JobResult": "launch",
    "render_batch": "batch",
}

__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
