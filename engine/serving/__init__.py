"""The engine's face: HTTP (OpenAI API), continuous batching, tokenizer, metrics, model files from a hub, the serve CLI."""
