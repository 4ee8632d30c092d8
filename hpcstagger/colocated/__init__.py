"""The co-located run: several training jobs in one MPI world on one node, started with a stagger.

What a run does, carried out on its ranks; what it decides comes from :mod:`hpcstagger.stagger`,
and the words it speaks (the spec, the environment contract, the record files) from
:mod:`hpcstagger.spec`.

- :mod:`.coordinator`: :func:`init` and :class:`Session` on every rank (identity, rendezvous, plan
  exchange, wait, backend); :mod:`._rendezvous`, the deadline rendezvous;
- :mod:`.watcher`: the closed loop's watcher thread on the last job's leader, and the waiting ranks'
  release; :mod:`.prefetch` and :mod:`.idle`: work done in the wait; :mod:`.parking`: a job held
  at its first batch, set up meanwhile;
- :mod:`.dataloader`: ``session.data_loader``, a SharedLoader or a plain DataLoader;
- :mod:`.progress`: a job leader's progress records; :mod:`.jobmeter`: calibration mode in a job;
  :mod:`.source_watch`: the observer of a run that learns;
- :mod:`.startcache`: the shared cache at the start (what it holds, making it cold);
- :mod:`.launch`: ``hpcstagger launch``, ``status`` and ``exec``, and the results from status
  files; :mod:`.batch`: the sbatch script of a spec (pure); :mod:`.preflight`: the checks before
  any rank starts; :mod:`.leftovers` and :mod:`._shm`: what runs leave in /dev/shm.

``hpcstagger.init`` and ``hpcstagger.Spec`` are the usual way in. This package exports those, the
job spec's :class:`JobSpec`, and :func:`launch` with its :class:`RunResult` and :class:`JobResult`
(``hpcstagger.colocated.launch`` is the function; ``importlib.import_module`` gives the module).
"""

from __future__ import annotations

from hpcstagger._lazy import lazy_exports, moved

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
_DEPRECATED = moved(__name__, {"PLAN_MODES": "hpcstagger.spec.jobspec", "resolve_job": "hpcstagger.spec.identity",
                               "plan_delays": "hpcstagger.stagger.delays",
                               "collect_results": "hpcstagger.colocated.launch",
                               "render_batch": "hpcstagger.colocated.batch"})

__all__ = ["Spec", "JobSpec", "init", "Session", "launch", "RunResult", "JobResult"]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals(), _DEPRECATED)
