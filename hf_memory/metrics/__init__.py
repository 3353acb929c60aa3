"""What a steering does and costs: likelihood margins, neutral-text cost, KV footprint, text
quality, and a judge of free-text replies fitted on the user's own pairs (``reply_judge``).
"""
