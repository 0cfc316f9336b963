"""The Trio I/O shell around one vLLM (docs/architecture.md "Layers"): the connection pool, discovery, the
health prober, the engine and its per-request tasks, the embedded API's streams, and the LoRA and RL Control
calls. It does the I/O and leaves every decision to the pure core (:mod:`trio_sidecar.core`).
"""
