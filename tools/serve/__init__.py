"""Serving: the OpenAI-compatible FastAPI app and its Ray Serve deployment."""
