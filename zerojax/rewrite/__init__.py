"""Transformations of the user's loss: its jaxpr re-run with gathers, tensor slices or remat applied."""
