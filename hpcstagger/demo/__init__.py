"""``hpcstagger demo``: two co-located training jobs on a slow emulated shared source, planned,
simultaneous and sequential, with predicted and measured makespans.

- :mod:`.data`: the synthetic image-like dataset (HDF5)
- :mod:`.models`: two small models
- :mod:`.job`: the training job each rank runs (``python -m hpcstagger.demo.job``)
- :mod:`.run`: the driver behind ``hpcstagger demo``
- :mod:`.report`: its table, the notes under it (a busy node, a simultaneous plan's reason) and the plot
"""

from __future__ import annotations

__all__: list[str] = []
