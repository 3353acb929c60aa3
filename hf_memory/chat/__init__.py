"""Chat-style generation: batched chat-template generation and multi-turn conversations."""
