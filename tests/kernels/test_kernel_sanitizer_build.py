"""kernels/cpu_library.py's sanitizer switch (OMNI_KERNEL_SANITIZERS, what scripts/test_sanitizers.sh sets): the
flags and the separate build folder, and refusals that say why instead of aborting the process."""

import pytest

from kernels.cpu_library import CpuKernelUnavailable, sanitizer_build


def test_no_sanitizers_adds_nothing():
    assert sanitizer_build("") == ([], "")


def test_undefined_adds_float_cast_overflow_into_its_own_folder():
    flags, folder = sanitizer_build("undefined")
    assert flags == ["-fsanitize=undefined,float-cast-overflow", "-fno-omit-frame-pointer", "-g"]
    assert folder == "sanitize-undefined"


@pytest.mark.skipif("libasan" in open("/proc/self/maps").read(), reason="this process has the runtime")
def test_address_without_its_runtime_preloaded_is_refused_naming_the_fix():
    with pytest.raises(CpuKernelUnavailable, match="needs the AddressSanitizer runtime preloaded"):
        sanitizer_build("undefined,address")


def test_an_unknown_sanitizer_is_refused():
    with pytest.raises(CpuKernelUnavailable, match="unknown sanitizer 'thread'; choose from address, undefined"):
        sanitizer_build("thread")
