"""kvflow: an LLM inference engine and server written to be read."""

__version__ = "0.1.0"

from kvflow.outputs import CompletionOutput, RequestOutput  # noqa: E402
from kvflow.sampling_params import SamplingParams  # noqa: E402


def __getattr__(name: str):
    # LLM pulls in torch and the model code; load it only when asked for.
    if name == "LLM":
        from kvflow.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
