"""IPIP-50 Big Five self-evaluation (DAS, appendix D.1): the task, its generation variant, its
report and its items."""
