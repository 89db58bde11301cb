"""The serving side: an OpenAI-compatible chat server on an embedded vLLM engine (docs/design.md §3)."""
