"""gRPC on the serving port: HTTP/2 connections (session.py) carrying calls (call.py) to the
same servicers as baidu_std, and the optional standard services (health.py, reflection.py)."""
