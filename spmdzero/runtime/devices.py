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


TPU_PCI_VENDOR = "0x1ae0"  # Google; how torch_xla itself counts TPU chips


def _select_device_type() -> str:
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
    device_type = _select_device_type()
    if device_type == "TPU":
        import glob

        count = 0
        for vendor_file in glob.glob("/sys/bus/pci/devices/*/vendor"):
            with open(vendor_file) as f:
                count += f.read().strip() == TPU_PCI_VENDOR
        return count
    return cpu_device_count()
