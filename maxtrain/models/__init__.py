"""Model families and the facts that follow from a model's shape (maxtrain.models.registry).

Where things go. A new model family: one module here that registers its ModelSpec (decoder.py has the
parts maxtrain's decoder gives every family; hf.py the HF layout they share), plus its presets in
configs/models/ and its tests; nothing else names it. Layer-stack names: stacks.py alone.
"""
