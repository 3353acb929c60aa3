"""vLLM plugin speed and load (run with .venv-vllm/bin/python)."""
