"""Whether steering persists over a conversation: the task, its report and its payload schema."""
