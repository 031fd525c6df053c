"""Vendors' HTTP speech APIs, each one file: a dialect translates its request fields onto the one whole-text
core (:mod:`gateway.dialects.whole_text`: the fields of ``/v1/audio/speech``, checked by
:func:`gateway.fields.speech_request`, streamed by :func:`gateway.streaming.stream_response`) and the core's
errors (:class:`gateway.errors.APIError`, its kinds set once where they arise) into its own error shape, once.

A dialect module has ``add_routes(app, core)``; it decides only names and shapes: its fields, its formats
(onto :mod:`gateway.encode`'s), its framing of the core's audio bytes (bytes, SSE events, JSON lines) and its
error body. Adding a vendor is one file here and its registration in :func:`gateway.app.create_app`.

Vendors' agent WebSockets are dialects too, of the text-socket core (:mod:`gateway.text_socket`): a socket
dialect (``cartesia_socket``, ``elevenlabs_socket``) translates each message onto the core's operations
(take a piece of text, end, cancel, keep alive, finish) and renders the core's events (audio, a unit's
timing, a context's end, an error) as its replies; adding a vendor's socket is one such file.
"""
