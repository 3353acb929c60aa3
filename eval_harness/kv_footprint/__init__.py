"""KV footprint (eq. 10): bank bytes against the descriptor's prompt KV."""
