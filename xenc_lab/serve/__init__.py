"""``xenc-lab serve``: a Scorer behind vLLM's scoring API (FastAPI + uvicorn, the ``serve`` extra).

``app.create_app(scorer)`` builds the app, ``batcher`` shares engine calls between clients, ``usage`` counts tokens,
``schemas`` holds the request and response bodies, ``errors`` the error bodies and the size limit, ``server`` runs
the app in a thread, ``command`` is the subcommand and ``bench`` measures served against offline pairs/s. Nothing
here is imported by ``import xenc_lab``.
"""
