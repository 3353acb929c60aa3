"""What steering costs on questions it should not touch: the task, its report and its payload
schema."""
