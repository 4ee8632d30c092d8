"""Knobs: defaults, environment overrides, test overrides, and clear errors."""

from __future__ import annotations

import os

import pytest

from hpcstagger import config
from hpcstagger.errors import ConfigError


def test_default_environment_and_override(monkeypatch):
    monkeypatch.delenv("HPCSTAGGER_COLLECTIVE_TIMEOUT", raising=False)
    assert config.get("collective_timeout") == 300.0
    monkeypatch.setenv("HPCSTAGGER_COLLECTIVE_TIMEOUT", "12.5")
    assert config.get("collective_timeout") == 12.5
    with config.override(collective_timeout=1.0):
        assert config.get("collective_timeout") == 1.0
        with config.override(collective_timeout=2.0):
            assert config.get("collective_timeout") == 2.0
        assert config.get("collective_timeout") == 1.0
    assert config.get("collective_timeout") == 12.5


def test_bad_environment_value_names_the_variable(monkeypatch):
    monkeypatch.setenv("HPCSTAGGER_COLLECTIVE_TIMEOUT", "soon")
    with pytest.raises(ConfigError, match="HPCSTAGGER_COLLECTIVE_TIMEOUT='soon' is not a valid float"):
        config.get("collective_timeout")


def test_unknown_knob_lists_valid_ones():
    with pytest.raises(ConfigError, match="unknown knob 'nope'; valid knobs: .*collective_timeout"):
        config.get("nope")
    with pytest.raises(ConfigError):
        with config.override(nope=1):
            pass


def test_shm_root_default_is_per_user(monkeypatch):
    monkeypatch.delenv("HPCSTAGGER_SHM_ROOT", raising=False)
    assert config.get("shm_root") == f"/dev/shm/hpcstagger-{os.getuid()}"


def test_describe_lists_every_knob_with_its_variable():
    rows = {r["name"]: r for r in config.describe()}
    assert set(rows) == set(config.KNOBS)
    assert rows["collective_timeout"]["env"] == "HPCSTAGGER_COLLECTIVE_TIMEOUT"


def test_register_rejects_a_conflicting_definition():
    with pytest.raises(ConfigError, match="registered twice"):
        config.register(config.Knob("collective_timeout", int, 1, "other"))
