"""edgechat's quantizer: Hugging Face safetensors checkpoints to GGUF, without PyTorch.

Self-contained: imports nothing from the edgechat app, and nothing heavier than numpy and gguf
to convert (llama-cpp-python's libraries for the kernels and the quality report).
"""

from quantize.convert import BY_QUALITY, Result, convert
from quantize.errors import QuantizeError
from quantize.mixture import FILE_TYPES

__all__ = ["BY_QUALITY", "FILE_TYPES", "QuantizeError", "Result", "convert"]
