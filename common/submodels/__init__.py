"""How the baselines cut a submodel: width slices, magnitude thresholds, restoration,
channels, label split, LoRA ranks.
"""
