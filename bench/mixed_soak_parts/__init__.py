"""The parts of bench/mixed_soak.py: the server, victim-client and hostile-client processes, the
h11 HTTP/JSON client, /proc sampling and the SVG plot."""
