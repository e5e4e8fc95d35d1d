"""The decoding core: settings, trees, acceptance, the KV cache, the step and the one loop.
It runs any stock transformers model it is handed and imports nothing from the other folders
but heads/."""
