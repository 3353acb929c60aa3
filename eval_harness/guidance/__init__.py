"""Answer-format guidance rules: the task, its report, its rules and its payload schema."""
