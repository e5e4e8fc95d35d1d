"""From a model id or directory to a ready backbone, tokenizer and heads, with the defaults and
the tree that suit this machine."""
