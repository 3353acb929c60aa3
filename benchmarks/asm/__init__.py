"""ASM speed: the scan, decoding and a training step against a matched Llama."""
