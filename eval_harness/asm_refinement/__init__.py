"""ASM refinement geometry and interventions: the task, its report and its payload schema."""
