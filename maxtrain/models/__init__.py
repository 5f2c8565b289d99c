"""What the model computes, in logical axis names only: the model families (registry.py: one ModelSpec
each) and the parts their layers are built from: each a spec that holds what a family chose and counts
its parameters and FLOPs, beside the module that runs it (layers.py: Norm, GatedMLP; attention.py: GQA;
mla.py: MLA; moe.py: MoE), gathered in args.py's ModelArgs; decoder.py composes them. How a layer runs on
the devices is the execution plan's (maxtrain.parallel.plan), handed in through the args.

A new model family: one module here that registers its ModelSpec (decoder_spec.py has the parts
maxtrain's decoder gives every family; hf.py the HF layout they share), plus its presets in
configs/models/ and its tests; nothing else names it (qwen3.py is the example). Layer-stack names:
stacks.py alone.
"""
