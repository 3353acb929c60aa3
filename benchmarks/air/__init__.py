"""AIR and Arith speed: puzzle generators and training steps."""
