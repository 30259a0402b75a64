"""edgechat: offline LLM chat on your own machine, built on llama.cpp."""

__version__ = "0.1.0"
