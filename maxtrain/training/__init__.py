"""The training run once the config is resolved: the loop (loop.py: one method per duty, clean-up in
finally), the state it starts from (state.py), the evaluation (evaluation.py) and the non-finite guard
(guards.py). The entry point, maxtrain/train.py, only wires config -> trainer -> loop."""
