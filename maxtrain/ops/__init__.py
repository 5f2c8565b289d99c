"""Kernels that know nothing of the mesh: attention (dot_product, blockwise, jax_nn, the splash kernel),
the grouped matmul of the experts. The plan (maxtrain.parallel.plan) runs
them on each device's share. A new kernel: a function here and one line in the plan's choice.
"""
