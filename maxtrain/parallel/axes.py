"""Logical axis names the model and the parallel code agree on, for arrays that cross between them."""

EXPERT_WEIGHT_AXES = ("experts", "embed", "moe_mlp")  # an expert weight [E, D, F]
ACTIVATION_AXES = ("batch", "length", "embed")  # what a layer reads and writes [B, L, D]
