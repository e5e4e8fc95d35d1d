"""Medusa heads: the module, every published file layout, head quantization, what heads are worth."""
