"""How artifacts reach disk and the Hub: crash-safe writes, uploads."""
