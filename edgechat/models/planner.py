"""Memory planning: will this model fit here, and with how much context?

weights (the file, memory-mapped) + KV cache (2 x layers x KV heads x head dim x cells x bytes,
GQA- and sliding-window-aware, see ModelInfo.kv_cache_bytes; an image's cells count like tokens)
+ compute buffers (with flash attention or without) + the tokenizer's tables + the vision projector
(its file's size), against the memory the OS says is available. Runs before llama.cpp is asked to
load anything.
"""

from __future__ import annotations

import os
import platform
import subprocess
from dataclasses import dataclass
from pathlib import Path

from edgechat.errors import ModelTooLargeError, UsageError
from edgechat.models.ggufinfo import ModelInfo
from edgechat.params import FlashAttn, KVType, SwaCache, choice

#: default context cap: long enough for real chats, small enough to start fast on a phone
DEFAULT_CTX_CAP = 4096
MIN_CTX = 512
#: bytes per KV element by cache type (q8_0: 34 bytes per 32 values, q4_0: 18 per 32)
KV_BYTES: dict[str, float] = {KVType.F16: 2.0, KVType.Q8_0: 34 / 32, KVType.Q4_0: 18 / 32}
#: leave this share of available memory to the OS and other programs
HEADROOM = 0.85
#: on Android the low-memory killer ends apps well before MemAvailable reaches zero
ANDROID_HEADROOM = 0.70


def headroom() -> float:
    """The share of available memory a plan may use here."""
    from edgechat.android import on_android

    return ANDROID_HEADROOM if on_android() else HEADROOM


def _meminfo(field: str) -> int | None:
    """A /proc/meminfo value in bytes (Linux and Android), None elsewhere."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def available_memory() -> int:
    """Bytes the OS can give us now (MemAvailable on Linux and Android)."""
    avail = _meminfo("MemAvailable")
    if avail is not None:
        return avail
    if platform.system() == "Darwin":
        try:
            out = subprocess.run(["sysctl", "-n", "hw.memsize"], capture_output=True, text=True, check=True).stdout
            return int(int(out) * 0.6)  # macOS reports no "available"; assume most of RAM is reclaimable
        except (OSError, ValueError, subprocess.CalledProcessError):
            pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 4 << 30


def total_memory() -> int:
    total = _meminfo("MemTotal")
    if total is not None:
        return total
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


@dataclass(frozen=True)
class Plan:
    n_ctx: int  # per sequence
    n_seq: int
    weights: int
    kv_cache: int
    compute: int
    available: int
    #: llama.cpp's full-size sliding-window cache (False: the small one, for SWA models only)
    swa_full: bool = True
    #: the vision projector's weights (projector_bytes), 0 for a text-only model
    projector: int = 0
    #: llama.cpp's tokenizer tables (tokenizer_bytes)
    tokenizer: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.compute + self.projector + self.tokenizer

    @property
    def fits(self) -> bool:
        return self.total <= self.available * headroom()


#: what llama.cpp's vocabulary takes in memory per token (texts, the lookup maps, BPE merges):
#: measured 320-350 bytes a token for BPE vocabularies (Qwen2.5, SmolLM2), 165 for Gemma 3's
TOKENIZER_BYTES_PER_TOKEN = 320


def _n_vocab(info: ModelInfo) -> int:
    return info.n_vocab or max(32000, info.n_params // max(info.n_embd, 1) // 8)


def tokenizer_bytes(info: ModelInfo) -> int:
    """llama.cpp's tokenizer tables once loaded (0 for an ONNX folder: its measured resident size
    counts them)."""
    return 0 if info.resident_bytes else TOKENIZER_BYTES_PER_TOKEN * _n_vocab(info)


def _compute_bytes(info: ModelInfo, n_ctx: int, flash_attn: bool, n_ubatch: int = 512) -> int:
    # the logits of a few rows (llama.cpp's output buffer)
    output = 4 * _n_vocab(info) * 8
    if flash_attn:
        # llama.cpp's CPU compute buffer with flash attention (its log, Qwen2.5 0.5B at 4k-32k,
        # SmolLM2, Gemma 3): one ubatch's feed-forward activations (3 x n_ff + 4 x n_embd floats a
        # token) and the f16 mask (context x ubatch); the tiled kernel keeps no scores
        n_ff = info.n_ff or 4 * info.n_embd
        return 4 * n_ubatch * (3 * n_ff + 4 * info.n_embd) + 2 * n_ubatch * n_ctx + output
    # without it the attention scores dominate (ubatch x context x heads, f32); activations ~16 x n_embd
    return 4 * n_ubatch * (16 * info.n_embd + info.n_head * n_ctx) + output


def projector_bytes(path: Path | None) -> int:
    """What a projector (mmproj GGUF) takes once loaded: its file's size (its weights; the
    encoder's compute buffer is small beside them for the projectors that ship); 0 for none."""
    return path.stat().st_size if path is not None else 0


def plan_for(info: ModelInfo, n_ctx: int, n_seq: int = 1, kv_type: KVType | str = KVType.F16, available: int | None = None,
             swa_full: bool = True, projector: int = 0, flash_attn: FlashAttn | str = FlashAttn.AUTO) -> Plan:
    """`flash_attn` as the engine is given it: auto is on where llama.cpp runs on the CPU, and a
    quantized KV cache turns it on."""
    avail = available_memory() if available is None else available
    swa_full = swa_full or not info.n_swa_layers
    kv = int(info.kv_cache_bytes(n_ctx * n_seq, kv_bytes(info, kv_type), swa_full=swa_full, n_seq=n_seq))
    weights = info.resident_bytes or info.size_bytes
    # flash attention is llama.cpp's; onnxruntime (which fixes the KV elements) keeps the scores
    flash = info.kv_element_bytes is None and (flash_attn != FlashAttn.OFF or kv_type != KVType.F16)
    return Plan(n_ctx, n_seq, weights, kv, _compute_bytes(info, n_ctx * n_seq, flash), avail, swa_full, projector,
                tokenizer_bytes(info))


def kv_bytes(info: ModelInfo, kv_type: KVType | str = KVType.F16) -> float:
    """Bytes per KV element: the KV type's, or the runtime's where it fixes them (ONNX: float32)."""
    return info.kv_element_bytes or KV_BYTES[kv_type]


def _plans(info: ModelInfo, n_ctx: int, n_seq: int, kv_type: str, available: int | None, swa: str, projector: int = 0,
           flash_attn: str = FlashAttn.AUTO):
    """The plans to try for one context, preferred first. The full cache can shift and rewind
    anywhere; the small one (sliding layers keep only their window: Gemma 3 needs 3-5x less KV)
    cannot shift, so its conversations truncate."""
    if swa is not SwaCache.SMALL:
        yield plan_for(info, n_ctx, n_seq, kv_type, available, swa_full=True, projector=projector, flash_attn=flash_attn)
    if swa is not SwaCache.FULL and info.n_swa_layers:
        yield plan_for(info, n_ctx, n_seq, kv_type, available, swa_full=False, projector=projector, flash_attn=flash_attn)


def choose_context(
    info: ModelInfo,
    requested: int | None = None,
    n_seq: int = 1,
    kv_type: KVType | str = KVType.F16,
    available: int | None = None,
    swa: SwaCache | str = SwaCache.AUTO,
    label: str | None = None,
    projector: int = 0,
    flash_attn: FlashAttn | str = FlashAttn.AUTO,
    cap: int | None = DEFAULT_CTX_CAP,
) -> Plan:
    """The context to run with: the requested one if it fits, else the largest that fits, up to
    `cap` (None: the trained window, as a server for agents wants);
    for sliding-window models with `swa` auto, the small SWA cache where the full one would not fit.
    `label` is what messages call the model (the name the user typed; else the file's own name);
    `projector` the bytes of its vision projector (projector_bytes); `flash_attn` the engine's.

    Raises ModelTooLargeError (before llama.cpp loads anything) when not even MIN_CTX fits.
    """
    kv_type, swa = choice(KVType, kv_type, "kv_type"), choice(SwaCache, swa, "swa_cache")
    flash_attn = choice(FlashAttn, flash_attn, "flash_attn")
    trained = max(info.context_length, MIN_CTX)
    if requested is not None:
        if requested > trained:
            raise UsageError(
                f"--ctx {requested} is more than {label or info.name} was trained for ({trained} tokens); use --ctx {trained} or less"
            )
        for plan in _plans(info, requested, n_seq, kv_type, available, swa, projector, flash_attn):
            if plan.fits:
                return plan
        raise ModelTooLargeError(_too_large(label or info.name, plan))
    n = trained if cap is None else min(trained, cap)
    while True:
        for plan in _plans(info, n, n_seq, kv_type, available, swa, projector, flash_attn):
            if plan.fits:
                return plan
        if n <= MIN_CTX:
            raise ModelTooLargeError(_too_large(label or info.name, plan))
        n = max(MIN_CTX, n // 2)


#: before a model is downloaded only its file size is known: the KV cache and compute buffers of a
#: small context are allowed for as this share of the weights (the real plan is made from the
#: file's header once it is here)
_UNKNOWN_OVERHEAD = 0.10


def weights_fit(size_bytes: int, available: int | None = None) -> bool:
    """Will a model of this file size fit with a small context? For catalog entries not yet downloaded."""
    avail = available_memory() if available is None else available
    return size_bytes * (1 + _UNKNOWN_OVERHEAD) <= avail * headroom()


def max_context_that_fits(info: ModelInfo, kv_type: KVType | str = KVType.F16, available: int | None = None,
                          projector: int = 0) -> int:
    """For `edgechat doctor`: the largest power-of-two context (up to the trained one) that fits,
    the projector's `projector` bytes counted; 0 if none."""
    best, n = 0, MIN_CTX
    while n <= info.context_length:
        if not any(p.fits for p in _plans(info, n, 1, kv_type, available, SwaCache.AUTO, projector)):
            break
        best, n = n, n * 2
    return best


#: of a GPU's free memory, what `--gpu-layers auto` leaves to the driver and other programs
GPU_HEADROOM = 0.90


@dataclass(frozen=True)
class GpuSplit:
    """Where the model's layers go: llama.cpp offloads the last `gpu_layers` of `n_layer` to
    `devices` (split between them by free memory) and keeps the first ones on the CPU."""

    gpu_layers: int
    n_layer: int
    devices: tuple[str, ...] = ()

    @property
    def cpu_layers(self) -> int:
        return self.n_layer - self.gpu_layers

    @property
    def n_gpu_layers(self) -> int:
        """llama.cpp's n_gpu_layers, which counts the output layer as one more (offloaded first):
        -1 is every layer and the output."""
        if not self.devices or not self.gpu_layers:
            return 0
        return -1 if self.gpu_layers >= self.n_layer else self.gpu_layers + 1

    def describe(self) -> str:
        if not self.gpu_layers:
            return "CPU"
        where = "+".join(self.devices)
        if not self.cpu_layers:
            return f"{where} (all {self.n_layer} layers)"
        return f"{where} {self.gpu_layers}/{self.n_layer} layers, CPU {self.cpu_layers}"


def parse_gpu_layers(value: str | int | None) -> str | int:
    """`auto`, `all` or a layer count, as the CLI and config.toml write it; UsageError otherwise."""
    if value is None:
        return "auto"
    if isinstance(value, int) or str(value).strip().isdigit():
        return int(value)
    text = str(value).strip().lower()
    if text not in ("auto", "all"):
        raise UsageError(f"GPU layers are auto, all or a number, not '{value}' (--gpu-layers, or gpu_layers in config.toml)")
    return text


def gpu_split(info: ModelInfo, plan: Plan, request: str | int | None, gpus) -> GpuSplit:
    """How many layers go to `gpus` (devices.Device list with free memory, from llama.cpp's own
    device queries). `auto`: as many as their free memory holds next to those layers' share of the
    KV cache and the compute buffers of `plan`; none without a GPU."""
    n_layer = max(info.n_layer, 1)
    wanted = parse_gpu_layers(request)
    names = tuple(d.name for d in gpus)
    if not gpus or wanted == 0:
        return GpuSplit(0, n_layer)
    if wanted == "all":
        return GpuSplit(n_layer, n_layer, names)
    if isinstance(wanted, int):
        return GpuSplit(min(wanted, n_layer), n_layer, names)
    # the file's bytes spread over the layers plus one layer's worth for embeddings and output
    per_layer = info.size_bytes / (n_layer + 1) + plan.kv_cache / n_layer
    budget = sum(d.free for d in gpus) * GPU_HEADROOM - plan.compute - info.size_bytes / (n_layer + 1)
    return GpuSplit(max(0, min(n_layer, int(budget // per_layer))), n_layer, names)


def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"


def _too_large(name: str, plan: Plan) -> str:
    projector = f", vision projector {_mib(plan.projector)}" if plan.projector else ""
    return (
        f"{name} needs about {_mib(plan.total)} with a {plan.n_ctx}-token context "
        f"(weights {_mib(plan.weights)}, KV cache {_mib(plan.kv_cache)}{projector}) but only "
        f"{_mib(plan.available * headroom())} is free; close other programs, use a smaller --ctx "
        f"or --kv-type q8_0, or pick a smaller model (edgechat models)"
    )


THREADS_ENV = "EDGECHAT_THREADS"


def default_threads() -> int:
    """Threads when none are asked for: $EDGECHAT_THREADS (for several edgechat processes sharing
    the cores: llama.cpp's threads spin at barriers and slow to a crawl when oversubscribed), else
    the physical cores."""
    value = os.environ.get(THREADS_ENV, "").strip()
    if value.isdigit() and int(value) >= 1:
        return int(value)
    return physical_cores()


def physical_cores() -> int:
    """Physical cores (llama.cpp gains nothing from SMT siblings); logical count as a fallback."""
    try:
        cores = set()
        phys = core = None
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("physical id"):
                    phys = line.split(":")[1].strip()
                elif line.startswith("core id"):
                    core = line.split(":")[1].strip()
                elif not line.strip():
                    if core is not None:
                        cores.add((phys, core))
                    phys = core = None
        if cores:
            return len(cores)
    except OSError:
        pass
    return os.cpu_count() or 1
