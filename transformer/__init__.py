"""The original Transformer: model, search and training pieces."""
