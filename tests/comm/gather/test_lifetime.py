"""An asynchronous device gather on a communication stream keeps its temporaries (staging,
the input, the fallback's full buffer) alive until its handle is waited for: the memory pools
would otherwise give their memory to new work on the caller's stream while the communication
stream still reads or writes it. Checked on ``fp8blk.comm.gather.streams.run`` with a stand-in for the streams
(the GPU suites run the real ones)."""
import gc
import weakref

from fp8blk.comm.gather import streams as gather_streams


class _Streams:
    """What ``run`` needs of ``DeviceStreams``: a side stream that records an event."""
    ptr = 1234

    def __init__(self):
        self.waited = False

    def begin(self):
        pass

    def context(self):
        return gather_streams.NULL

    def torch_context(self):
        return gather_streams.NULL

    def end(self, async_op):
        if not async_op:
            return None
        return lambda: setattr(self, "waited", True)


class _Comm:
    stream_ordered = True
    orders_torch_stream = False


class _Temp:
    pass


def test_async_handle_keeps_temporaries_until_waited():
    temp, streams = _Temp(), _Streams()
    ref = weakref.ref(temp)
    issued = []
    handle = gather_streams.run(_Comm(), lambda ptr: issued.append(ptr), lambda: None, streams,
                         streams.ptr, True, "result", keep=temp)
    del temp
    gc.collect()
    assert issued == [1234]
    assert ref() is not None, "freed while the communication stream may still use it"
    assert handle.wait() == "result" and streams.waited
    del handle
    gc.collect()
    assert ref() is None, "kept after the handle was waited for and dropped"


def test_synchronous_call_keeps_nothing():
    temp, streams = _Temp(), _Streams()
    ref = weakref.ref(temp)
    assert gather_streams.run(_Comm(), lambda ptr: None, lambda: None, streams, streams.ptr, False,
                       "result", keep=temp) is None
    del temp
    gc.collect()
    assert ref() is None
