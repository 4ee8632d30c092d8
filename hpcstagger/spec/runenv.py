"""The environment contract between the launcher and the ranks of a co-located run.

``hpcstagger launch``, the rendered batch scripts and the Slurm templates set these variables;
:func:`hpcstagger.init` reads them on every rank. They are defined here and nowhere else.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from hpcstagger.errors import ConfigError

__all__ = ["SPEC", "JOB", "MODE", "PLAN_MODES", "PLAN_MODES_IN_WORLD", "PLANNED_MODES", "DELAYS", "RUN_DIR",
           "NO_HISTORY", "ONLY", "CALIBRATE", "CALIBRATE_UNTIL", "CACHE_CAPACITY", "encode_delays", "decode_delays"]

SPEC = "HPCSTAGGER_SPEC"          # path of the job spec
JOB = "HPCSTAGGER_JOB"            # this rank's job: a name, or an index into the spec's jobs
MODE = "HPCSTAGGER_PLAN_MODE"     # overrides [plan] mode (hpcstagger launch --mode)
PLAN_MODES = ("plan", "open", "simultaneous", "sequential", "fixed")  # what MODE and [plan] mode take
PLAN_MODES_IN_WORLD = ("plan", "open", "simultaneous", "fixed")  # sequential is one launch per job
PLANNED_MODES = ("plan", "open")  # the model's delays: "plan" steers them while the run goes on, "open" does not
DELAYS = "HPCSTAGGER_DELAYS"      # JSON {job: seconds}, for mode "fixed" (hpcstagger launch --delays)
RUN_DIR = "HPCSTAGGER_RUN_DIR"    # where status files go (default: <workdir>/status)
NO_HISTORY = "HPCSTAGGER_NO_HISTORY"  # "1": plan without the spec's run history (hpcstagger launch --no-history)
ONLY = "HPCSTAGGER_ONLY_JOBS"     # comma-separated: this launch runs only these jobs of the spec
CALIBRATE = "HPCSTAGGER_CALIBRATE"  # calibration mode (hpcstagger calibrate --spec): the job's reports directory
CALIBRATE_UNTIL = "HPCSTAGGER_CALIBRATE_UNTIL"  # calibration mode: when (epoch seconds) the job's share of time ends
CACHE_CAPACITY = "HPCSTAGGER_CACHE_CAPACITY"  # bytes: [cache] capacity "auto" as sized once for the whole run
PLAN_AHEAD = "HPCSTAGGER_LAUNCHER_PLAN"  # "<pid>:<path>": the launcher's planning process and the file of its plan


def encode_delays(delays: Mapping[str, float]) -> str:
    """The value of :data:`DELAYS` for fixed delays ``{job: seconds}``."""
    return json.dumps({str(k): float(v) for k, v in delays.items()})


def decode_delays(environ: Mapping[str, str]) -> dict[str, float] | None:
    """The fixed delays that :data:`DELAYS` holds in ``environ``, or None when it is unset.

    Raises ConfigError when the value is not a JSON object of numbers.
    """
    text = environ.get(DELAYS)
    if not text:
        return None
    try:
        value = json.loads(text)
        if not isinstance(value, dict):
            raise ValueError("not an object")
        return {str(k): float(v) for k, v in value.items()}
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{DELAYS} must be a JSON object of seconds per job, e.g. "
                          f"'{{\"b\": 12.5}}', got {text!r} ({exc})") from None
