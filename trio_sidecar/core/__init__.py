"""The pure core (docs/architecture.md "Layers"): values, checks, conversions and policies. No I/O, no Trio.

Every module here is a plain function of its inputs (tests/unit/test_purity.py checks their imports); the
Trio shell (:mod:`trio_sidecar.shell`) and the Dynamo adapter call into it, never the other way round.
"""
