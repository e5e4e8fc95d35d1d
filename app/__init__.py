"""The Medusa chat app: engine (model, queue, streaming), readout (speed numbers) and ui (Gradio page)."""
