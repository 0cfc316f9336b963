"""Shared test configuration.

Area fixtures live next to their tests (``tests/<area>/conftest.py``). Every server in a test binds
127.0.0.1 on port 0 and is started with ``nursery.start`` (or a subprocess killed by PID).
"""
