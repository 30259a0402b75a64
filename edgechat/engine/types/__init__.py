"""The engine's vocabulary: a request (`ChatRequest`, its `Tools`), its status and events, the
handle they come back on, its metrics. Imports nothing else of the engine."""
