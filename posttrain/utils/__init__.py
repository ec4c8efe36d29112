"""Utilities: logging, checkpoints, timers, progress, plots."""
