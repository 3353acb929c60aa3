"""The stock models memory inception steers: architecture adapters, the embedded default model,
fingerprints, transformers compatibility.
"""
