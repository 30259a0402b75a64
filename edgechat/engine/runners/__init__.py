"""The model runners: the `ModelRunner` protocol, llama.cpp's (`LlamaBackend`) and onnxruntime's,
the vision/audio projector, ggml's devices, native sampler chains. The only code that binds
llama.cpp or onnxruntime; it knows nothing of requests."""
