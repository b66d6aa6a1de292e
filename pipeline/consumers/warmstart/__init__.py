"""The warm start: supervised fine-tuning of the base model before RL (``sft``), and its folders and done marker
(``config``, importable without torch)."""
