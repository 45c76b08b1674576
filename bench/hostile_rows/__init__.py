"""Pieces of bench/hostile_server.py: the served process (serve.py), the hand-driven clients
(peers.py) and the hostile rows (rows.py)."""
