"""kvserve: an LLM inference and serving engine built around KV-cache memory management."""
from kvserve.engine.args import EngineArgs
from kvserve.llm import LLM
from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.sampling_params import SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "EngineArgs", "RequestOutput", "CompletionOutput", "__version__"]
