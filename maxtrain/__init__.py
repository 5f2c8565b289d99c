"""maxtrain: config-driven LLM pretraining in JAX."""
