"""Training heads: data, prompts, the loss, evaluation, the loop and the tree search."""
