"""edgechat: offline LLM chat on your own machine, built on llama.cpp."""

__version__ = "0.1.0"

# before anything imports llama_cpp: its loader refuses sys.platform "android" (edgechat/android.py)
from edgechat.android import install_import_shim as _install_import_shim  # noqa: E402

_install_import_shim()
