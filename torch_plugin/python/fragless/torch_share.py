"""torch.multiprocessing's CUDA tensors through fragless.share, under fragless.torch.enable().

PyTorch pickles a CUDA tensor for another process with torch.multiprocessing.reductions.reduce_tensor,
registered with multiprocessing's ForkingPickler for torch.Tensor, Parameter and the tensor classes; for a
CUDA storage it calls storage._share_cuda_(), which asks the allocator for a legacy IPC handle
(shareIpcHandle) that CUDAPluggableAllocator refuses. install() registers a reduction for the same classes
that sends the storage's fragless allocation as a fragless.Shared instead, and leaves every other tensor
(CPU tensors, CUDA memory fragless did not allocate) to PyTorch's own. The receiving process opens it and
gets a CUDA tensor over the opened memory through __cuda_array_interface__ (torch.as_tensor keeps a
reference to the holder and drops it when the storage dies: tensor_from_cuda_array_interface), whose
deletion closes it (fragless.close_shared).
"""
from multiprocessing.reduction import ForkingPickler

from . import share as _share

_original = None


def install(torch):
    """Registers the reduction (once); PyTorch's own stays the fallback."""
    global _original
    if _original is not None:
        return
    import torch.multiprocessing.reductions as reductions
    _original = reductions.reduce_tensor
    classes = list(getattr(torch, "_tensor_classes", ())) + [torch.Tensor, torch.nn.parameter.Parameter]
    for cls in classes:
        ForkingPickler.register(cls, _reduce_tensor)


def _reduce_tensor(tensor):
    storage = tensor.untyped_storage()
    if storage.device.type != "cuda" or storage.nbytes() == 0 or (tensor.requires_grad and not tensor.is_leaf):
        return _original(tensor)  # CPU tensors, empty storages, and PyTorch's own error for non-leaf tensors
    try:
        shared = _share.share(storage.data_ptr())
    except RuntimeError as e:
        if "did not allocate" in str(e):
            return _original(tensor)  # not fragless's memory
        raise RuntimeError("fragless: this CUDA tensor cannot be sent to another process: %s" % e) from None
    return (_rebuild_cuda_tensor, (type(tensor), tuple(tensor.size()), tuple(tensor.stride()), tensor.storage_offset(),
                                   tensor.dtype, storage.device.index, storage.nbytes(), shared, tensor.requires_grad))


class _Opened:
    """Opened fragless memory as __cuda_array_interface__ bytes; closed when the last tensor over it goes."""

    def __init__(self, ptr, nbytes):
        self.ptr = ptr
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 2,
                                         "strides": None}

    def __del__(self):
        try:
            _share.close_shared(self.ptr)
        except Exception:  # interpreter shutdown
            pass


def _rebuild_cuda_tensor(cls, size, stride, offset, dtype, device, nbytes, shared, requires_grad):
    import torch
    ptr, opened = _share.open_shared(shared, device)
    shared.close()
    if opened < nbytes:
        _share.close_shared(ptr)
        raise RuntimeError("fragless: the opened block (%d bytes) is smaller than the tensor's storage (%d bytes)"
                           % (opened, nbytes))
    with torch.cuda.device(device):
        raw = torch.as_tensor(_Opened(ptr, nbytes), device="cuda:%d" % device)
    t = torch.as_strided(raw.view(dtype), size, stride, offset)
    if cls == torch.nn.parameter.Parameter:
        return torch.nn.parameter.Parameter(t, requires_grad=requires_grad)
    t.requires_grad = requires_grad
    return t
