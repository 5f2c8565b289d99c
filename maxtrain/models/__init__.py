"""What the model computes, in logical axis names only: the model families (registry.py: one ModelSpec
each) and the layers they are built from (args.py, layers.py, attention.py, moe.py, decoder.py). How a
layer runs on the devices is the execution plan's (maxtrain.parallel.plan), handed in through the args.

A new model family: one module here that registers its ModelSpec (decoder_spec.py has the parts
maxtrain's decoder gives every family; hf.py the HF layout they share), plus its presets in
configs/models/ and its tests; nothing else names it (qwen3.py is the example). Layer-stack names:
stacks.py alone.
"""
