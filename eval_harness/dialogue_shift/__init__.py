"""Dialogue shift: the task, its cases and style judge, its report and its payload schema."""
