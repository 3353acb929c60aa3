"""Trait steering on the likelihood pairs: the task (calibration, sweeps, layer ablation), its
report and its pairs."""
