"""Tools over whole runs, for the command line and the benchmarks.

- :mod:`.spec_calibration`: ``hpcstagger calibrate SPEC``, each job measured from its own command,
  then the source; :mod:`.saved_parts` keeps each part as it is measured;
- :mod:`.sweep`: ``hpcstagger sweep``, the plan against measured staggers; :mod:`.sweep_report`
  its table and plot (the demo draws its timelines with it);
- :mod:`.tables`: byte counts and aligned text tables.
"""

from __future__ import annotations

__all__: list[str] = []
