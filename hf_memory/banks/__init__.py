"""Memory banks: latent key/value slots built from text, and the bank set that is saved and pushed.
"""
