"""Kernels that know nothing of the mesh: attention, the chunked loss."""
