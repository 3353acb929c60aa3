"""FFN layers as key-value memories (the task runs in ``hf_memory.analysis``): its report and its
payload schema."""
