"""Search defaults every caller shares, importable without torch (the command line's ``--help``)."""

DEFAULT_COST_BUDGET = 0.1  # nats per token of neutral text a steering may cost
