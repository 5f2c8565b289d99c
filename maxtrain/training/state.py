"""The state a run starts from, and a rollback with no checkpoint goes back to."""

from __future__ import annotations

import jax

from maxtrain.config import load as config_lib
from maxtrain.observe import fit, progress
from maxtrain.training import step as step_lib
from maxtrain.runtime.console import say


def initial_state(c: config_lib.Config, trainer: step_lib.Trainer, checkpointer, batches):
    """Resume this run; else load_full_state_path; else load_parameters_path; else fresh init."""
    if checkpointer is not None:
        with progress.heartbeat(f"reading the newest checkpoint in {checkpointer.directory}"):
            state = checkpointer.restore(trainer.abstract_state, batches)
        if state is not None:
            say(checkpointer.resumed_line)
            return trainer.to_run(state)
    if c.load_full_state_path:
        from maxtrain.checkpoint import loading as ckpt_loading  # orbax loads only where needed: see TrainLoop.run
        say(f"loading full state from {c.load_full_state_path}")
        state = trainer.to_run(ckpt_loading.load_full_state(c, trainer.abstract_state))
        ckpt_loading.load_data_position(c, batches)
        return state
    init = trainer.init.lower(jax.random.key(c.init_weights_seed)).compile()
    fit.check_compiled(init, trainer.mesh, "initializing the state")  # its temporaries can exceed the state's size
    state = init(jax.random.key(c.init_weights_seed))
    if c.load_parameters_path:
        from maxtrain.checkpoint import loading as ckpt_loading
        say(f"loading parameters from {c.load_parameters_path}")
        state = state.replace(params=trainer.to_run(ckpt_loading.load_parameters(c, trainer.abstract_state.params)))
    return state
