"""Named rematerialization policies (MaxText's names) built on `checkpoint_name` tags.

The model tags the outputs worth keeping with `checkpoint_name(x, TAG)`; a policy says which tagged
(or which kinds of) intermediates the backward pass may keep instead of recomputing.
"""

import jax

# Tags the model puts on intermediates (maxtrain.models: layers, attention, moe).
QUERY, KEY, VALUE, CONTEXT, OUT = "query_proj", "key_proj", "value_proj", "context", "out_proj"
MLP_IN, MLP_OUT = "mlpwi", "mlpwo"

_save = jax.checkpoint_policies.save_only_these_names

# name -> policy; None means no remat at all (every activation is kept).
POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "minimal": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
    "save_dot_with_context_except_mlp": _save(QUERY, KEY, VALUE, CONTEXT, OUT),
    "save_dot_except_mlpwi": _save(QUERY, KEY, VALUE, OUT, MLP_OUT),
    "save_dot_except_mlp": _save(QUERY, KEY, VALUE, OUT),
    "save_qkv_proj": _save(QUERY, KEY, VALUE),
    "save_out_proj": _save(OUT),
}
POLICY_NAMES = tuple(POLICIES)
