"""Speed and memory benchmarks by subject, each run as a module from the repo root."""
