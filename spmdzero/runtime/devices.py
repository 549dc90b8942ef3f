"""Which device type this process will drive, decided before any runtime starts: every TPU
chip the host has (counted on the PCI bus, as torch_xla counts them), else ``CPU_NUM_DEVICES``
virtual CPU devices (8 when unset), the embedded default for examples, tests and CI."""

from __future__ import annotations
import os


DEFAULT_CPU_DEVICES = 8


class EnvironmentSettingError(ValueError):
    """An environment variable spmdzero reads holds a value it cannot use; the message names
    the variable, its value and what it takes."""


def cpu_device_count() -> int:
    """``CPU_NUM_DEVICES`` (8 when unset), checked: torch_xla reads ``"x"``, ``"0"`` or ``"-1"``
    as no device at all, and every later step would fail far from the cause."""
    text = os.environ.get("CPU_NUM_DEVICES")
    if text is None:
        return DEFAULT_CPU_DEVICES
    try:
        count = int(text)
    except ValueError:
        count = 0
    if count < 1:
        raise EnvironmentSettingError(f"CPU_NUM_DEVICES={text!r} is not a device count: set it to a positive "
                                      f"integer (the number of virtual CPU devices), or unset it for "
                                      f"{DEFAULT_CPU_DEVICES}")
    return count


POOL_PER_DEVICE = 2  # XLA:CPU client threads per virtual device (``size_cpu_thread_pool``)


def size_cpu_thread_pool(device_count: int) -> None:
    """Give XLA:CPU's client at least ``POOL_PER_DEVICE`` threads a virtual device, before a CPU
    client starts (JAX's or torch_xla's; both read ``NPROC`` then, as their core count).

    Why: XLA runs every virtual device's part of a program on one pool of max(cores, devices)
    threads, and a collective holds its thread until every device's part has arrived. When a
    thread is busy elsewhere (the next program's part, dispatched while this one runs), some
    parts never start and XLA aborts the process after 10 s: "Termination timeout for `all
    reduce RendezvousKey{...}` ... Expected 8 threads to join the rendezvous". On a 2-core host
    with 8 devices, a loop of sharded programs with no host read in it aborted 5 of 5 runs on
    JAX and 3 of 3 on torch_xla with the default pool, none of 13 and 3 with twice the devices
    (tests/test_runtime.py runs that loop on both). A host with more cores than that already
    has the threads; an ``NPROC`` set outside is kept."""
    if "NPROC" in os.environ:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if POOL_PER_DEVICE * device_count > cores:
        os.environ["NPROC"] = str(POOL_PER_DEVICE * device_count)


TPU_PCI_VENDOR = "0x1ae0"  # Google; how torch_xla itself counts TPU chips


def select_device_type() -> str:
    """Decided before torch_xla is imported, which would otherwise pick (and log) its own."""
    if "PJRT_DEVICE" in os.environ:
        return os.environ["PJRT_DEVICE"]
    import glob
    import importlib.util

    if importlib.util.find_spec("libtpu") is not None:
        for vendor_file in glob.glob("/sys/bus/pci/devices/*/vendor"):
            with open(vendor_file) as f:
                if f.read().strip() == TPU_PCI_VENDOR:
                    return "TPU"
    return "CPU"


def visible_device_count() -> int:
    """Devices the runtime would use, found without starting it (the CLI must not claim a
    TPU another process is training on): TPU chips on the PCI bus, else CPU_NUM_DEVICES."""
    device_type = select_device_type()
    if device_type == "TPU":
        import glob

        count = 0
        for vendor_file in glob.glob("/sys/bus/pci/devices/*/vendor"):
            with open(vendor_file) as f:
                count += f.read().strip() == TPU_PCI_VENDOR
        return count
    return cpu_device_count()
