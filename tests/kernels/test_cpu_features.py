"""How the CPU's features become a kernel tier and its compile flags: on Linux from /proc/cpuinfo, on macOS
from sysctl (read here from a recorded Mac's answers), and the variants within a tier (AVX-VNNI on avx2,
dotprod and i8mm on neon)."""

from __future__ import annotations

import subprocess

import pytest

from kvflow.kernels import build, cpu_features

# What `sysctl -n KEY` answers on an Apple M2 (an M1 answers 0 for FEAT_I8MM) and on an Intel Mac
# (Ice Lake); keys a machine lacks fail.
APPLE_M2 = {"hw.optional.AdvSIMD": "1", "hw.optional.neon": "1", "hw.optional.arm.FEAT_DotProd": "1",
            "hw.optional.arm.FEAT_I8MM": "1", "machdep.cpu.brand_string": "Apple M2"}
INTEL_MAC = {"machdep.cpu.features": "FPU VME SSE SSE2 SSE3 SSSE3 FMA SSE4.1 SSE4.2 POPCNT AVX1.0 F16C",
             "machdep.cpu.leaf7_features": "SMEP BMI1 AVX2 BMI2 AVX512F AVX512DQ AVX512CD AVX512BW AVX512VL "
                                           "AVX512VNNI",
             "machdep.cpu.brand_string": "Intel(R) Core(TM) i7-1068NG7 CPU @ 2.30GHz"}


def answering(values: dict[str, str]):
    def run(cmd, **kwargs):
        assert cmd[:2] == ["sysctl", "-n"]
        key = cmd[2]
        return subprocess.CompletedProcess(cmd, 0 if key in values else 1, values.get(key, ""), "")
    return run


def test_an_apple_silicon_mac_reads_its_features_from_sysctl(monkeypatch):
    monkeypatch.setattr(cpu_features.subprocess, "run", answering(APPLE_M2))
    flags = cpu_features.darwin_flags()
    assert flags == {"asimd", "asimddp", "i8mm"}
    assert build.tier_flags("neon", machine="arm64", flags=flags) == ("-march=armv8.2-a+dotprod+i8mm",)
    monkeypatch.setattr(cpu_features.subprocess, "run", answering({**APPLE_M2, "hw.optional.arm.FEAT_I8MM": "0"}))
    assert cpu_features.darwin_flags() == {"asimd", "asimddp"}  # an M1


def test_on_macos_the_flags_and_name_come_from_sysctl(monkeypatch):
    monkeypatch.setattr(cpu_features.subprocess, "run", answering(APPLE_M2))
    monkeypatch.setattr(cpu_features.platform, "system", lambda: "Darwin")
    cached = (cpu_features.cpu_flags, cpu_features.cpu_name)
    for read in cached:
        read.cache_clear()
    try:
        assert cpu_features.cpu_flags() == {"asimd", "asimddp", "i8mm"}
        assert cpu_features.cpu_name() == "Apple M2"
    finally:
        for read in cached:  # this machine's own, read again when next asked
            read.cache_clear()


def test_an_intel_mac_reads_its_features_from_sysctl(monkeypatch):
    monkeypatch.setattr(cpu_features.subprocess, "run", answering(INTEL_MAC))
    flags = cpu_features.darwin_flags()
    assert {"avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= flags
    if cpu_features.tiers() == cpu_features.X86_TIERS:
        assert cpu_features.machine_tier(flags) == "avx512"


def test_a_mac_without_sysctl_has_no_flags(monkeypatch):
    def missing(cmd, **kwargs):
        raise FileNotFoundError(cmd[0])
    monkeypatch.setattr(cpu_features.subprocess, "run", missing)
    assert cpu_features.darwin_flags() == frozenset()


# machine_tier ranks flags by the host's own tier list: on an ARM host x86 flags name no tier (the ARM
# tiers' flags are checked in test_tier_variants_in_the_compile_flags).
@pytest.mark.skipif(cpu_features.tiers() != cpu_features.X86_TIERS, reason="x86 tiers")
def test_x86_tiers_from_flags():
    avx2 = frozenset({"avx2", "fma", "f16c"})
    assert cpu_features.machine_tier(frozenset({"sse2"})) == "generic"
    assert cpu_features.machine_tier(avx2) == "avx2"
    assert cpu_features.machine_tier(avx2 | {"avx_vnni"}) == "avx2"  # a tier of its own only with AVX-512
    zen4 = avx2 | {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16"}
    assert cpu_features.machine_tier(zen4) == "avx512"
    assert cpu_features.machine_tier(zen4 | {"amx_int8", "amx_bf16", "amx_tile"}) == "amx"


def test_tier_variants_in_the_compile_flags():
    assert "-mavxvnni" in build.tier_flags("avx2", machine="x86_64", flags=frozenset({"avx2", "avx_vnni"}))
    assert "-mavxvnni" not in build.tier_flags("avx2", machine="x86_64", flags=frozenset({"avx2"}))
    neon = {"asimd", "asimddp"}
    assert build.tier_flags("neon", machine="aarch64", flags=frozenset(neon)) == ("-march=armv8.2-a+dotprod",)
    assert build.tier_flags("neon", machine="aarch64", flags=frozenset(neon | {"i8mm"})) == \
        ("-march=armv8.2-a+dotprod+i8mm",)
    # i8mm without dotprod (no such CPU ships): neither, as the packed kernel's i8mm path builds on dotprod's
    assert build.tier_flags("neon", machine="aarch64", flags=frozenset({"asimd", "i8mm"})) == ("-march=armv8-a",)


def test_a_forced_tier_must_exist_and_not_exceed_the_machine(monkeypatch):
    cpu_features.isa_tier.cache_clear()
    try:
        monkeypatch.setenv("KVFLOW_ISA", "generic")
        assert cpu_features.isa_tier() == "generic"
        cpu_features.isa_tier.cache_clear()
        monkeypatch.setenv("KVFLOW_ISA", "sse9")
        with pytest.raises(ValueError, match="not a tier"):
            cpu_features.isa_tier()
        cpu_features.isa_tier.cache_clear()
        monkeypatch.setattr(cpu_features, "machine_tier", lambda flags=None: "generic")
        higher = cpu_features.tiers()[1]
        monkeypatch.setenv("KVFLOW_ISA", higher)
        with pytest.raises(ValueError, match="asks for more"):
            cpu_features.isa_tier()
    finally:
        cpu_features.isa_tier.cache_clear()
