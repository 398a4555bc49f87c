# The peer's build flags by LLAMACPP_ISA (sourced by setup_llamacpp.sh and setup_llama_server.sh):
#   native  GGML_NATIVE=ON: every feature of this CPU (the default)
#   avx2    AVX2 + FMA + F16C only, no AVX-512 or AMX: the peer for kvflow's KVFLOW_ISA=avx2 on a bigger CPU
#           (with AVX-VNNI where the CPU has it, as kvflow's avx2 tier takes it there)
#   sse     SSE only (llama.cpp then reports SSE3 and SSSE3), no AVX at all (x86-64 CPUs before AVX2, and
#           VMs that hide it): the peer for kvflow's KVFLOW_ISA=generic on x86
case "${LLAMACPP_ISA:-native}" in
    native)
        isa_flags="-DGGML_NATIVE=ON"
        default_venv="$repo_root/.venv-llamacpp" ;;
    avx2)
        isa_flags="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF"
        avx_vnni=OFF
        grep -qw avx_vnni /proc/cpuinfo 2>/dev/null && avx_vnni=ON
        isa_flags="$isa_flags -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=$avx_vnni"
        isa_flags="$isa_flags -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
        default_venv="$repo_root/.venv-llamacpp-avx2" ;;
    sse)
        isa_flags="-DGGML_NATIVE=OFF -DGGML_SSE42=ON -DGGML_AVX=OFF -DGGML_AVX2=OFF -DGGML_FMA=OFF -DGGML_F16C=OFF"
        isa_flags="$isa_flags -DGGML_BMI2=OFF -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF"
        isa_flags="$isa_flags -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF"
        isa_flags="$isa_flags -DGGML_AMX_BF16=OFF"
        default_venv="$repo_root/.venv-llamacpp-sse" ;;
    *)
        echo "LLAMACPP_ISA must be native, avx2 or sse, not ${LLAMACPP_ISA}" >&2
        exit 2 ;;
esac
