"""What a steering does and costs: likelihood margins, neutral-text cost, KV footprint, text
quality.
"""
