"""The decoders' own stages: pairs rendered through a chat template (``chat``), shared prefixes found on token ids
(``prefix``), chunks packed over a paged KV cache (``chunks``, ``kv_cache``), and the engine that runs them
(``engine``)."""
