"""OpenAI-compatible HTTP front end for the Triton server (``python -m gateway --triton HOST:8001``)."""
