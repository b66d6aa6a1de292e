"""Tiny models and tokenizers built locally from a config, for CPU recipes and tests (nothing comes from a hub).

``pipeline.models.tiny.init_tiny_model`` writes one; the import is not done here so that
``python -m pipeline.models.tiny`` runs the module only once.
"""
