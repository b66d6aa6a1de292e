"""Prompt data shared by the stages that read it (producers, the warm start, held-out evaluation): sources, the
synthetic tasks and the held-out split."""
