"""The persona A/B steering benchmark (steering-bench's sets of Anthropic's model-written
evaluations): its compact data, the converter that writes it, the task and its report."""
