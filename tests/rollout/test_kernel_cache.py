"""The kernels' build cache may be shared between machines (a cluster's home directory): each CPU keeps
its own build, and a build replaces only its own CPU's older builds. Built here from a one-line source
(the real kernels take seconds), with two fake CPU signatures."""

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
