"""Serving: the OpenAI-compatible FastAPI app (app.py: create_app) and its Ray Serve deployment.

Routes, a module per endpoint family: completions.py, chat.py (with tools), models.py,
tokens.py (/tokenize, /detokenize), health.py (/health, /metrics). What they share: state.py
(settings, pool, metrics, ApiError), validation.py (a request body -> the runtime's parameters),
choices.py (admission, one request's choices), generation.py (one choice on a pooled generator),
streaming.py (server-sent events), responses.py (OpenAI's response shapes), middleware.py (API key,
access log, error handlers), pool.py, metrics.py; ray_serve.py runs the same app on Ray Serve.
"""
