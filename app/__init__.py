"""The Medusa chat app: the page (ui, built from layout, model_panel and chat_controller), the request
settings and per-tab sessions, the engine that runs the model, the OpenAI-compatible API, and the
readout, rendering and transcripts they share."""
