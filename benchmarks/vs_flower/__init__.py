"""Time to accuracy against stock Flower: the comparison's runner, its fleet-time scoring and the
stock app."""
