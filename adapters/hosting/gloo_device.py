"""One gloo TCP device for all the torch.distributed process groups of an engine core on CPU.

vLLM's CPU worker runs torch.distributed even for one process: the world group and one group per kind of parallelism,
each with a device-side and a CPU-side group, 13 in all, every one on gloo. torch gives each gloo group a TCP device
of its own, and each device's loop thread wakes every 10 ms (gloo's epoll timeout) whether anything is sent or not:
an idle engine core spent ~1.2 % of a core in those 13 threads (`strace -c`: nothing but epoll_wait), a default
gateway's three engines ~3.6 %, and on a 2-core machine their ~4,000 wake-ups a second interrupt the engines that are
computing. Groups can share a device (ProcessGroupGloo takes its devices in its options; torch's own tests pass one
device to many groups), so here every gloo group the process creates without options of its own gets the process's
one device: one loop thread. `python benchmarks/engines/bench_engine_start.py --compare revision --revision REV` measures
an idle gateway both ways (benchmarks/results/engine_start_gloo.md).

Applied by replacing `ProcessGroupGloo` in torch.distributed.distributed_c10d, where torch's group factory and its
type checks look it up, with a subclass that also counts torch's own instances (a backend torch hands back from C++
is of the original class) as its own; `torch.distributed.ProcessGroupGloo` (RPC's) stays torch's. Left as torch has it
where its ProcessGroupGloo takes no options with devices, and for a group made while GLOO_SOCKET_IFNAME names the
interfaces (torch then makes a device on each).
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta

log = logging.getLogger(__name__)


def share_one_gloo_device() -> bool:
    """From now on this process's gloo groups share one TCP device; False (torch left as it is) where this torch's
    ProcessGroupGloo cannot be given devices."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        return False
    import torch.distributed.distributed_c10d as c10d

    stock = c10d.ProcessGroupGloo
    if getattr(stock, "shares_one_device", False):
        return True
    options_class = getattr(stock, "_Options", None)
    if options_class is None or not hasattr(options_class(), "_devices") or not hasattr(stock, "create_default_device"):
        log.warning("this torch's ProcessGroupGloo takes no devices in its options: each gloo group keeps a TCP device "
                    "of its own (a loop thread waking every 10 ms)")
        return False

    class CountsStockInstances(type(stock)):
        def __instancecheck__(cls, instance) -> bool:
            return isinstance(instance, stock)

        def __subclasscheck__(cls, subclass) -> bool:
            return issubclass(subclass, stock)

    device = []  # made at the first group; a forked child's loop thread would not exist, so it makes its own
    os.register_at_fork(after_in_child=device.clear)

    class OneDeviceGloo(stock, metaclass=CountsStockInstances):
        shares_one_device = True

        def __init__(self, store, rank: int, size: int, *args, **kwargs):
            # torch's group factory and vLLM pass `timeout=` alone; any other call (options of its own) goes as torch's
            timeout = kwargs.get("timeout")
            if args or set(kwargs) != {"timeout"} or not isinstance(timeout, timedelta) \
                    or os.environ.get("GLOO_SOCKET_IFNAME"):
                super().__init__(store, rank, size, *args, **kwargs)
                return
            options = options_class()
            options._timeout = timeout
            if not device:
                device.append(stock.create_default_device())
            options._devices = [device[0]]
            super().__init__(store, rank, size, options)

    OneDeviceGloo.__name__ = OneDeviceGloo.__qualname__ = stock.__name__
    OneDeviceGloo.__module__ = stock.__module__
    c10d.ProcessGroupGloo = OneDeviceGloo
    return True
