"""Queue consumers: the trainer (``trainer/``: loop, drain, commit, checkpoints), the RL maths (``rl/``), the warm start
(``warmstart/``), the Megatron-core model (``megatron/``), the stream evaluator (``evaluator``) and the checkpoint
export (``export``)."""
