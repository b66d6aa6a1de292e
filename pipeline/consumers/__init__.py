"""Queue consumers: the staleness policy, the Megatron-core trainer, the evaluator and offline replay."""
