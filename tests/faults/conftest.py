"""The fault suite: real processes, real sockets, nodes as network namespaces where root is available.

Fixtures shared by every fault test live in tests/conftest.py (agents, peer processes, random bytes);
what only fault tests need lives here.
"""
