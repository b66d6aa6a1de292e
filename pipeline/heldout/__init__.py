"""Held-out evaluation: a stage of its own that generates from the trainer's weight snapshots (or checkpoints) on
prompts never trained on. It uses the producers' rollout and rewards and the consumers' snapshots and export, which
is why it sits above both stages rather than inside either."""
