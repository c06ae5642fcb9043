"""How the baselines cut submodels: widths, thresholds, restoration, channels, labels, LoRA."""
