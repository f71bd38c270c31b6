"""torch.multiprocessing sends a CUDA tensor fragless allocated to another process under
fragless.torch.enable(): the receiver's tensor sees the sender's bytes and the sender sees the receiver's;
its deletion closes the opened memory; the sender's block is freed once the receiver let it go. Needs
PyTorch with CUDA and a GPU, and FRAGLESS_CONF with shareable_handles:True (set here). Exits 77 (skipped)
otherwise."""
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "torch_plugin", "python"))
sys.path.insert(0, os.path.dirname(__file__))
try:
    import torch
    import torch.multiprocessing as mp
except ImportError:
    print("SKIPPED: PyTorch is not installed for %s" % sys.executable)
    sys.exit(77)
if not torch.cuda.is_available():
    print("SKIPPED: PyTorch has no usable CUDA device here (%s, torch %s): the two-process CUDA tensor exchange "
          "under fragless.torch.enable() runs only on a GPU machine" % (sys.executable, torch.__version__))
    sys.exit(77)
os.environ["FRAGLESS_CONF"] = "shareable_handles:True"
import fragless  # noqa: E402
import fragless.torch as ft  # noqa: E402
from checks import check  # noqa: E402


def receiver(q_in, q_out):
    ft.enable()
    t = q_in.get()
    check(t.is_cuda and t.dtype == torch.float32 and tuple(t.shape) == (1024, 1024), (t.device, t.dtype, t.shape))
    check(bool((t == 3.0).all()), "the sender's values")
    t.fill_(7.0)
    torch.cuda.synchronize()
    check(ft.memory_stats()["imported_bytes.all.current"] >= t.numel() * 4, "imported bytes counted")
    q_out.put("written")
    del t
    import gc
    gc.collect()
    check(ft.memory_stats()["imported_bytes.all.current"] == 0, "the tensor's deletion closed it")
    q_out.put("closed")


if __name__ == "__main__":
    print("interpreter: %s, torch %s" % (sys.executable, torch.__version__))
    ft.enable()
    ctx = mp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=receiver, args=(q_in, q_out))
    p.start()
    x = torch.full((1024, 1024), 3.0, device="cuda")
    torch.cuda.synchronize()
    q_in.put(x)
    check(q_out.get(timeout=120) == "written", "the receiver wrote")
    check(bool((x == 7.0).all()), "the receiver's values, here")
    del x
    check(q_out.get(timeout=120) == "closed", "the receiver closed it")
    p.join(60)
    check(p.exitcode == 0, "receiver exit code %s" % p.exitcode)
    for _ in range(5000):
        if fragless.reap_shared() or ft.memory_stats()["exported_bytes.all.current"] == 0:
            break
        time.sleep(0.002)
    check(ft.memory_stats()["exported_bytes.all.current"] == 0, "the sender's block went back")
    print("torch.multiprocessing CUDA tensor exchange under fragless.torch.enable(): OK")
