"""Search defaults every caller shares, importable without torch (the command line's ``--help``)."""

DEFAULT_COST_BUDGET = 0.1  # nats per token of neutral text a steering may cost
DEFAULT_KV_CEILING = 0.25  # a persona's banks: at most this share of its text's KV as a prompt
CAPABILITY_SLACK = 0.1  # nats per factual answer a persona may cost above the visible prompt
