"""Development tools that are not part of the runtime: :mod:`.local` starts a local Dynamo deployment on
loopback (the mock, ``dynamo.frontend``, trio-sidecar or the native sidecar) for ``examples/demo.py``, the
benchmarks and the tests."""
