"""Steering (memory inception) speed: generate, serving shapes, step costs, calibration."""
