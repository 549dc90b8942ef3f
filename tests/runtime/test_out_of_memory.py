"""A device that runs out of memory raises torch's OutOfMemoryError, the error accelerate's
``find_executable_batch_size`` (the Trainer's ``--auto_find_batch_size``) shrinks the batch on
(spmdzero/runtime/out_of_memory.py). The Trainer's run: tests/compat/test_hugging_face.py."""

import jax
import pytest
import torch

from spmdzero.runtime.out_of_memory import raises_torch_out_of_memory

should_reduce_batch_size = pytest.importorskip("accelerate.utils.memory").should_reduce_batch_size

# what XLA says, as JAX raises it
COMPILE = ("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space hbm. "
           "Used 20.5G of 15.48G hbm. Exceeded hbm capacity by 5.02G.")
ALLOCATE = "RESOURCE_EXHAUSTED: Out of memory allocating 1099511627776 bytes."
AT_A_READ = ("INTERNAL: Buffer Definition Event: Error dispatching computation: Error preparing computation: "
             "Out of memory allocating 1099511627776 bytes.")


def raising(err):
    @raises_torch_out_of_memory
    def call():
        raise err
    return call


@pytest.mark.parametrize("message", [COMPILE, ALLOCATE, AT_A_READ])
def test_xla_out_of_memory_is_torchs_with_the_words_accelerate_looks_for(message):
    err = jax.errors.JaxRuntimeError(message)
    assert not should_reduce_batch_size(err)  # why: as JAX raises it, the batch would never shrink
    with pytest.raises(torch.OutOfMemoryError) as raised:
        raising(err)()
    assert should_reduce_batch_size(raised.value)
    assert message in str(raised.value) and raised.value.__cause__ is err


@pytest.mark.parametrize("err", [jax.errors.JaxRuntimeError("INVALID_ARGUMENT: shapes differ"),
                                 RuntimeError("mat1 and mat2 shapes cannot be multiplied"),
                                 ValueError("out of memory"),
                                 torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")])
def test_other_errors_pass_unchanged(err):
    with pytest.raises(type(err)) as raised:
        raising(err)()
    assert raised.value is err
