"""Makespan model (placeholder while building)."""
