"""``deepspeed.utils``: DeepSpeed's logger, ``log_dist`` and ``RepeatingLoader``."""

from .logging import log_dist, logger  # noqa: F401


class RepeatingLoader:
    """DeepSpeed's: iterate ``loader`` forever, starting it again when it ends."""

    def __init__(self, loader):
        self.loader = loader
        self.data_iter = iter(loader)

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)


def __getattr__(name):
    from .._unsupported import unsupported_attribute

    raise unsupported_attribute("deepspeed.utils", name)
