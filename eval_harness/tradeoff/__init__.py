"""Steering movement against its capability cost at matched strength: the task and its report."""
