"""Quality probes: what steering does to a model, not how fast (run as modules)."""
