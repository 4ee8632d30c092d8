"""The vocabulary of a co-located run, shared by the planner, the run and the tools over runs.

- :mod:`.jobspec`: the job spec (TOML), validated field by field: :class:`Spec`, :class:`JobSpec`;
- :mod:`.runenv`: the ``HPCSTAGGER_*`` variables the launcher passes to every rank;
- :mod:`.identity`: which job of a spec a rank belongs to (pure);
- :mod:`.records`: the run's record files (a leader's progress, each rank's status), their paths
  and their readers.
"""

from __future__ import annotations

from hpcstagger._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "Spec": "hpcstagger.spec.jobspec",
    "JobSpec": "hpcstagger.spec.jobspec",
}

__all__ = ["Spec", "JobSpec"]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
