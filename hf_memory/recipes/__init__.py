"""Ready-made uses: personas, the shipped Big Five selectors and their data, the demo, one question
answered by every method.
"""
