"""Input pipelines (grain) and tokenizers."""
