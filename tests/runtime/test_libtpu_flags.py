"""spmdzero's libtpu flags: merged into the user's LIBTPU_INIT_ARGS the same way by the AOT
compile and by a TPU VM's bootstrap, the user's own settings winning; no TPU needed."""

import os

import pytest

from spmdzero import runtime
from spmdzero.runtime import libtpu_flags

OURS = {"xla_tpu_a": "true", "xla_tpu_b": "7"}


def test_the_flags_are_added_after_the_users():
    assert libtpu_flags.merged("", OURS) == "--xla_tpu_a=true --xla_tpu_b=7"
    assert libtpu_flags.merged(" --xla_other=1 ", OURS) == "--xla_other=1 --xla_tpu_a=true --xla_tpu_b=7"


@pytest.mark.parametrize("user", ["--xla_tpu_a=false", "--xla_tpu_a false", "--noxla_tpu_a", "-xla_tpu_a=0"])
def test_a_flag_the_user_set_is_never_overridden(user):
    assert libtpu_flags.merged(user, OURS) == f"{user} --xla_tpu_b=7"


def test_apply_is_idempotent_and_can_be_switched_off():
    env = {"LIBTPU_INIT_ARGS": "--xla_tpu_b=1"}
    once = libtpu_flags.apply(env)
    assert env["LIBTPU_INIT_ARGS"] == once == libtpu_flags.merged("--xla_tpu_b=1")
    assert libtpu_flags.apply(env) == once  # a child process inheriting it adds nothing twice
    for name, value in libtpu_flags.FLAGS.items():
        assert f"--{name}={value}" in once
    off = {"LIBTPU_INIT_ARGS": "--xla_tpu_b=1", libtpu_flags.OPT_OUT: "0"}
    assert libtpu_flags.apply(off) == "--xla_tpu_b=1"
    assert libtpu_flags.apply({libtpu_flags.OPT_OUT: "0"}) == ""
    with pytest.raises(ValueError, match="SPMDZERO_LIBTPU_FLAGS='maybe'"):
        libtpu_flags.apply({libtpu_flags.OPT_OUT: "maybe"})


def test_the_tpu_bootstrap_applies_them_and_the_cpu_one_does_not(monkeypatch):
    """On a TPU VM ``import spmdzero`` sets them before torch_xla starts libtpu (here the
    runtime already runs on CPU: bootstrap is idempotent)."""
    monkeypatch.setenv("LIBTPU_INIT_ARGS", "--xla_user=1")
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    runtime.bootstrap()
    assert os.environ["LIBTPU_INIT_ARGS"] == "--xla_user=1"
    monkeypatch.setenv("PJRT_DEVICE", "TPU")
    runtime.bootstrap()
    assert os.environ["LIBTPU_INIT_ARGS"] == libtpu_flags.merged("--xla_user=1")


@pytest.mark.slow
def test_a_flag_libtpu_does_not_know_is_a_clear_aot_error(monkeypatch):
    """libtpu exits on an unknown flag while it loads; the AOT compile says which variable."""
    pytest.importorskip("libtpu")
    from spmdzero.tpu.capture import compile_mlir

    monkeypatch.setenv("LIBTPU_INIT_ARGS", "--xla_tpu_no_such_flag=true")
    monkeypatch.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    with pytest.raises(RuntimeError, match="(?s)xla_tpu_no_such_flag.*libtpu does not know a flag in LIBTPU_INIT_ARGS"):
        compile_mlir("module {}", "v5e:2x2")
