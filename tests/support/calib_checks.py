"""Checks of a calibrated scenario file shared by the calibration tests."""

from __future__ import annotations

import re

from hpcstagger.model import Scenario


def comment_mismatches(text: str, sc: Scenario) -> list[str]:
    """Every figure a comment of the scenario file states for the value it describes, where it
    differs from the value the file holds."""
    bad = []
    lines = text.splitlines()
    for line in lines:
        key, _, rest = line.partition(" = ")
        value, _, note = rest.partition("  # ")
        if not note:
            continue
        if key == "bandwidth":
            stated = re.match(r"holds ([\d., ]+) MB/s", note)
            held = ", ".join(f"{b / 1e6:.1f}" for b in sc.storage.bandwidth)
            if not stated or stated.group(1) != held:
                bad.append(f"bandwidth holds {held} MB/s: {note}")
        if key == "spread":
            held = ", ".join(f"{s * 100:.0f}%" for s in sc.storage.spread)
            if f"(max - min) / median: {held}" not in note:
                bad.append(f"spread holds {held}: {note}")
    for job in sc.jobs:
        note = next((ln for ln in lines if ln.startswith("# measured from its command:")
                     and f"{job.sample_time * 1e3:.3f} ms/sample" in ln), None)
        if note is None:
            bad.append(f"job {job.name}: no comment states its {job.sample_time * 1e3:.3f} ms/sample")
            continue
        for figure in (f"handoff {job.handoff * 1e3:.2f} ms/batch", f"start-up {job.startup:.2f} s",
                       f"prep {job.prep_time * 1e3:.3f} ms/sample", f"epoch restart {job.epoch_start:.2f} s"):
            if figure not in note:
                bad.append(f"job {job.name}: {figure!r} not in {note}")
    return bad
