"""CUDA benchmarks, all run by run.sh on a lent GPU machine."""
