"""Installing fragless into PyTorch (torch >= 2.1) through CUDAPluggableAllocator, with every hook.

    import fragless.torch
    fragless.torch.enable("policy:fragless")   # before the first CUDA allocation
"""
import ctypes
import os

import fragless as _f

memory_stats = _f.memory_stats
memory_summary = _f.memory_summary
snapshot = _f.snapshot
dump_snapshot = _f.dump_snapshot
empty_cache = _f.empty_cache
record_history = _f.record_history

_HOOKS = [  # (setter on torch._C._CUDAPluggableAllocator, exported function)
    ("set_init_fn", "fragless_init"),
    ("set_reset_fn", "fragless_empty_cache"),
    ("set_memory_fraction_fn", "fragless_set_memory_fraction"),
    ("set_base_alloc_fn", "fragless_get_base_allocation"),
    ("set_record_stream_fn", "fragless_record_stream"),
    ("set_begin_allocate_to_pool", "fragless_begin_allocate_to_pool"),
    ("set_end_allocate_to_pool_fn", "fragless_end_allocate_to_pool"),
    ("set_release_pool", "fragless_release_pool"),
]

_enabled = None


def enable(conf=None):
    """Make fragless PyTorch's CUDA allocator. `conf` is a FRAGLESS_CONF string (else the environment's).
    Must run before the first CUDA allocation; raises RuntimeError saying so otherwise. Returns the
    torch.cuda.memory.CUDAPluggableAllocator."""
    global _enabled
    if _enabled is not None:
        return _enabled
    try:
        import torch
    except ImportError as e:
        raise ImportError("fragless.torch.enable() needs PyTorch (>= 2.1); it is not importable here: %s" % e)
    if conf is not None:
        os.environ["FRAGLESS_CONF"] = conf
    path = _f.library_path()
    lib = _f.library()
    alloc = torch.cuda.memory.CUDAPluggableAllocator(path, "fragless_malloc", "fragless_free")
    backend = alloc.allocator()
    for setter, fn in _HOOKS:
        if hasattr(backend, setter):
            getattr(backend, setter)(ctypes.cast(getattr(lib, fn), ctypes.c_void_p).value)
    try:
        torch.cuda.memory.change_current_allocator(alloc)
    except RuntimeError as e:
        raise RuntimeError("fragless.torch.enable() must run before the first CUDA allocation of this process "
                           "(PyTorch said: %s). Call it at the top of your script, before any tensor is put "
                           "on a GPU." % e) from None
    _enabled = alloc
    return alloc
