# Types of events.py when Cython compiles it in place (aiobrpc/_compiled.py): an event is made
# without a Python frame for its __init__. The .py file is the source of both twins.

cdef class MessageReceived:
    cdef public object meta, data, attachment, error


cdef class RequestReceived(MessageReceived):
    pass


cdef class ResponseReceived(MessageReceived):
    pass


cdef class StreamFrameReceived:
    cdef public object meta, payload
