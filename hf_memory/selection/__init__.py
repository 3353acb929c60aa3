"""Where to steer: the selector artifact and the searches that calibrate it."""
