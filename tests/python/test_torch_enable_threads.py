"""fragless.torch.enable() called by several threads at once, with two settings: one settings wins; every call
with it returns what the first returned, and every call with the other raises RuntimeError naming the ones in
effect. Without the lock around enable() two threads could both find nothing enabled and both go on, the
later one's settings replacing the first's under it. Exits 77 (skipped) without PyTorch. Run with
FRAGLESS_LIBRARY set."""
import os
import threading

from torch_prologue import announce, check  # exits 77 (skipped) without PyTorch
announce()
os.environ.pop("FRAGLESS_CONF", None)
import fragless.torch as ft  # noqa: E402

confs = ("driver:host,capacity_mb:256", "driver:host,capacity_mb:512")
n = 16
barrier = threading.Barrier(n)
results = [None] * n


def call(i):
    barrier.wait()
    try:
        results[i] = ("ok", ft.enable(confs[i % 2]))
    except RuntimeError as e:
        results[i] = ("raised", str(e))


threads = [threading.Thread(target=call, args=(i,)) for i in range(n)]
for t in threads:
    t.start()
for t in threads:
    t.join()
won = [i % 2 for i, r in enumerate(results) if r[0] == "ok"]
check(len(set(won)) == 1, "both settings were enabled: %r" % (results,))
winner = won[0]
check(len(won) == n // 2, results)
check(len({id(r[1]) for r in results if r[0] == "ok"}) == 1, "the calls that succeeded returned different objects")
for i, r in enumerate(results):
    if i % 2 != winner:
        check(r[0] == "raised" and "already enabled" in r[1] and repr(confs[winner]) in r[1], r)
check(os.environ["FRAGLESS_CONF"] == confs[winner], os.environ.get("FRAGLESS_CONF"))
print("%d threads enabling at once: %r won, the %d calls with %r raised" % (n, confs[winner], n // 2, confs[1 - winner]))
