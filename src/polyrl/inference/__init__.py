"""OpenAI- and vLLM-compatible inference endpoints, shared by workers and the manager."""
