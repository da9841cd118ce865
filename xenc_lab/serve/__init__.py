"""``xenc-lab serve``: a Scorer behind vLLM's scoring API (FastAPI, uvicorn and prometheus-client: the ``serve`` extra).

``app.create_app(scorer)`` builds the app. A request passes ``access`` (one log line, the request metrics), ``guard``
(the API key; later the deadline), ``body`` (read whole within a size and a time limit), then ``parse`` (on a worker
thread: JSON, counts, refused fields, types, pairing; ``schemas`` holds the bodies, ``errors`` the error bodies) and
``batcher`` (engine calls shared between clients; ``truncation`` applies a request's side), counted by ``usage``.
``metrics`` is /metrics, ``protocol`` uvicorn's connection with a deadline on request heads, ``server`` runs the app
(graceful shutdown; in a thread for tests), ``command`` is the subcommand and ``bench`` measures served against offline
pairs/s. Nothing here is imported by ``import xenc_lab``.
"""
