"""What the model computes, in logical axis names only: the model families (registry.py: one ModelSpec
each) and the parts their layers are built from: parts.py holds each part's spec (what a family chose; its
counts and HF tensors), args.py's ModelArgs gathers a model's, and the modules run them (layers.py,
attention.py, mla.py, moe.py; decoder.py composes them). How a layer runs on the devices is the execution
plan's (maxtrain.parallel.plan), handed in through the args.

A new model family: one module here that registers its ModelSpec (decoder_spec.py has the parts
maxtrain's decoder gives every family; hf.py the HF layout they share), plus its presets in
configs/models/ and its tests; nothing else names it (qwen3.py is the example). Layer-stack names:
stacks.py alone.
"""
