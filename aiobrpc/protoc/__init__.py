"""protoc-gen-aiobrpc: typed stubs and servicers for the services of a .proto.

For each `x.proto` with services, the plugin writes `x_aiobrpc.py` beside protoc's
`x_pb2.py`: per service `XStub` (`await stub.Method(request, cntl=None)` on an
`aiobrpc.Channel`), `XSyncStub` (the same call, blocking, on an `aiobrpc.sync.Channel`) and
`XServicer` (an `aiobrpc.Servicer` with `SERVICE` set and one typed method per rpc), all
annotated with the `_pb2` message classes.

    python -m aiobrpc.protoc -I. --python_out=. --aiobrpc_out=. echo.proto

runs protoc (grpcio-tools', or `protoc` on PATH) with the plugin registered;
`protoc --aiobrpc_out=.` finds the installed `protoc-gen-aiobrpc` script by itself.
`--aiobrpc_opt=relative_imports` imports the other `_pb2` modules relatively, for generated
code kept inside a Python package.
"""
