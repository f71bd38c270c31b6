"""Sharing fragless memory with other processes (docs/PYTORCH.md, "Sharing across processes").

    s = fragless.share(ptr)                 # in the process that allocated ptr
    queue.put(s)                            # multiprocessing sends its descriptors along
    ptr2, size = fragless.open_shared(s)    # in the other process
    fragless.close_shared(ptr2)

The allocation stays held in its process, whatever its owner frees, while any copy of the share is open
anywhere (a process that dies closes its copies). Memory must be created exportable: shareable_handles:True
(or :fabric, cuda driver: the handles travel in the description, the lease alone as a descriptor). Both sides'
memory_stats() count it (exported_bytes.*, imported_bytes.*) and snapshot() shows it (docs/PYTORCH.md).
"""
import ctypes
import os

from . import _device, _pointer, library, last_error

__all__ = ["Shared", "share", "open_shared", "close_shared", "reap_shared"]

_declared = False


def _lib():
    global _declared
    lib = library()
    if not _declared:
        c = ctypes
        lib.fragless_share_export.restype = c.c_void_p
        lib.fragless_share_export.argtypes = [c.c_void_p]
        lib.fragless_share_description.restype = c.c_size_t
        lib.fragless_share_description.argtypes = [c.c_void_p, c.POINTER(c.c_void_p)]
        lib.fragless_share_fds.restype = c.c_size_t
        lib.fragless_share_fds.argtypes = [c.c_void_p, c.POINTER(c.POINTER(c.c_int))]
        lib.fragless_share_free.argtypes = [c.c_void_p]
        lib.fragless_open_shared.restype = c.c_void_p
        lib.fragless_open_shared.argtypes = [c.c_int, c.c_char_p, c.c_size_t, c.POINTER(c.c_int), c.c_size_t,
                                             c.POINTER(c.c_size_t)]
        lib.fragless_close_shared.restype = c.c_int
        lib.fragless_close_shared.argtypes = [c.c_void_p]
        lib.fragless_reap_shared.restype = c.c_size_t
        _declared = True
    return lib


class Shared:
    """A fragless allocation as another process can open it: a description and file descriptors (owned
    here, closed by close() or when the object goes). Pickle it through multiprocessing (a Queue, a Pipe,
    Process arguments): the descriptors travel as descriptors (multiprocessing.reduction.DupFd)."""

    def __init__(self, description, fds):
        self.description = bytes(description)
        self._fds = list(fds)

    @property
    def fds(self):
        return tuple(self._fds)

    def __reduce__(self):
        if not self._fds:
            raise ValueError("fragless.Shared: this share was closed; nothing to send")
        from multiprocessing.reduction import DupFd
        return (_rebuild, (self.description, [DupFd(fd) for fd in self._fds]))

    def close(self):
        fds, self._fds = self._fds, []
        for fd in fds:
            os.close(fd)

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass

    def __repr__(self):
        return "fragless.Shared(%d bytes of description, %d descriptors)" % (len(self.description), len(self._fds))


def _rebuild(description, dupfds):
    return Shared(description, [d.detach() for d in dupfds])


def share(ptr):
    """Exports the fragless allocation that starts at `ptr` (an int or ctypes pointer). Raises RuntimeError
    with fragless's reason (not a live allocation; memory not created exportable) when it cannot, TypeError
    for what is no pointer and ValueError for an int that is not an address."""
    ptr = _pointer(ptr, "fragless.share")
    lib = _lib()
    s = lib.fragless_share_export(ptr)
    if not s:
        raise RuntimeError(last_error())
    try:
        bytes_p = ctypes.c_void_p()
        n = lib.fragless_share_description(s, ctypes.byref(bytes_p))
        description = ctypes.string_at(bytes_p.value, n)
        fds_p = ctypes.POINTER(ctypes.c_int)()
        k = lib.fragless_share_fds(s, ctypes.byref(fds_p))
        fds = [os.dup(fds_p[i]) for i in range(k)]  # this object's own copies
    finally:
        lib.fragless_share_free(s)
    return Shared(description, fds)


def open_shared(shared, device=0):
    """Maps a Shared received from another process (or made here) on `device`: returns (ptr, size). Raises
    RuntimeError when fragless refuses it (forged, stale, malformed) or cannot map it; nothing is mapped then."""
    if not isinstance(shared, Shared):
        raise TypeError("fragless.open_shared: expected a fragless.Shared, got %s" % type(shared).__name__)
    if not shared._fds:
        raise ValueError("fragless.open_shared: this share was closed")
    device = _device(device)
    lib = _lib()
    fds = (ctypes.c_int * len(shared._fds))(*shared._fds)
    size = ctypes.c_size_t(0)
    p = lib.fragless_open_shared(device, shared.description, len(shared.description), fds, len(shared._fds),
                                 ctypes.byref(size))
    if not p:
        raise RuntimeError(last_error())
    return p, size.value


def close_shared(ptr):
    """Unmaps what open_shared mapped and drops its reference; RuntimeError when ptr is not such a pointer
    (TypeError when it is no pointer at all, ValueError when it is not an address)."""
    ptr = _pointer(ptr, "fragless.close_shared")
    lib = _lib()
    if lib.fragless_close_shared(ptr) != 0:
        raise RuntimeError(last_error())


def reap_shared():
    """Frees the allocations whose owner freed them and which no process has open any more (also done by
    allocations that miss the cache, empty_cache and statistics); returns how many."""
    return _lib().fragless_reap_shared()
