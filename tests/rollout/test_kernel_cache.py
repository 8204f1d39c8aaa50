"""The kernels' build cache may be shared between machines (a cluster's home directory): each CPU keeps
its own build, and a build replaces only its own CPU's older builds. Built here from a one-line source
(the real kernels take seconds), with two fake CPU signatures."""

import platform
import shutil

import pytest

from assay.rollout.engine import cpu_kernel

pytestmark = pytest.mark.skipif(shutil.which("cc") is None,  # "missing tool": CI fails it (tests/conftest.py)
                                reason="missing tool: no C compiler (cc) to build the kernels")


def test_each_cpu_keeps_its_own_build_and_never_deletes_another_cpus(tmp_path, monkeypatch):
    source = tmp_path / "one.c"
    source.write_text("int one(void) { return 1; }\n")
    monkeypatch.setenv("ASSAY_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cpu_kernel, "_SOURCES", (source,))

    def build(cpu: str):
        monkeypatch.setattr(cpu_kernel, "_cpu_signature", lambda: f"flags : fake {cpu}")
        return cpu_kernel._build()

    a, b = build("A"), build("B")
    assert a != b and a.is_file() and b.is_file()  # both CPUs' builds side by side
    assert build("A") == a  # found again, not rebuilt
    legacy = tmp_path / "cache" / "kernels" / "kernels-0123456789abcdef.so"  # an older Assay's build: CPU unknown
    legacy.write_bytes(b"")
    source.write_text("int one(void) { return 2; }\n")  # new sources: A builds again
    a2 = build("A")
    assert a2 != a and a2.is_file() and not a.exists()  # A's own older build is replaced
    assert b.is_file() and legacy.is_file()  # another CPU's build (or one of unknown CPU) is never deleted


def test_the_kernels_build_without_finite_math_assumptions():
    assert "-ffast-math" not in cpu_kernel._FLAGS and not any("finite-math-only" in f for f in cpu_kernel._FLAGS)
    assert {"-O3", "-march=native"} <= set(cpu_kernel._FLAGS)


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 targets")
def test_another_target_builds_apart_from_the_native_build(tmp_path, monkeypatch):
    """ASSAY_CPU_MARCH builds for an older target (an AVX2 build on an AVX-512 CPU): a build of its own, beside
    the native one, and the target's code really differs (no AVX-512 register in it)."""
    source = tmp_path / "add.c"
    source.write_text("void add(float *a, const float *b, int n) { for (int i = 0; i < n; i++) a[i] += b[i]; }\n")
    monkeypatch.setenv("ASSAY_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cpu_kernel, "_SOURCES", (source,))
    monkeypatch.setattr(cpu_kernel, "_cpu_signature", lambda: "flags : fake avx512f")
    native = cpu_kernel._build()
    monkeypatch.setenv("ASSAY_CPU_MARCH", "x86-64-v3")
    avx2 = cpu_kernel._build()
    assert avx2 != native and avx2.is_file() and native.is_file()
    assert b"zmm" not in _disassembly(avx2)
    monkeypatch.setenv("ASSAY_CPU_MARCH", "x86-64-v4")  # AVX-512: the same loop on 512-bit registers
    assert b"zmm" in _disassembly(cpu_kernel._build())


def _disassembly(library) -> bytes:
    import subprocess

    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.fail("missing tool: objdump (binutils), to read the kernels' build")
    return subprocess.run([objdump, "-d", str(library)], capture_output=True, check=True).stdout
