"""The keys' declarations, one module per group (maxtrain.config.schema.GROUPS): a key of group `data` is
declared in data.py, with its values or range, its checks and its platform default. A model family's own keys
are declared in the family's module (maxtrain/models/llama4.py)."""
