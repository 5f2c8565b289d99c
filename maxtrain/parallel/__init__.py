"""Everything that depends on the device mesh, and nothing that does not.

- mesh.py: the mesh axes and the device grid; remat.py: the named remat policies; axes.py: the logical names
  the model and this package agree on.
- rules.py: the one logical -> mesh resolver (flax's rule semantics, even splits only; sequence_shards: how a
  sequence's positions split), used for the parameters' shardings, the activations' constraints, the
  planners and the config's checks.
- plan.py: the execution plan the model receives: which attention kernel, chunks, remat, the scan's
  unroll, and the mesh-dependent ways to run a layer (context.py, experts.py, embedding.py, chunks.py)
  or a stack of layers over pipeline stages (pipeline.py), the only modules that call shard_map and
  collectives.

A new parallelism axis: its mesh axis in mesh.py MESH_AXES and the rules in base.yml, its
collectives here, and its choice in plan.py. A new kernel: a mesh-free function in maxtrain/ops/ and one
line in the plan (Plan.attend for attention).
"""
