"""What a GGUF file holds, read from its header without loading weights (for planner, doctor, models)."""

from __future__ import annotations

import mmap
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

from edgechat.errors import ModelFormatError, ModelNotFoundError
from edgechat.params import SAMPLING_LIMITS

GGUF_MAGIC = b"GGUF"

# GGUF value types (gguf spec): id -> struct format; 8 is a string, 9 an array
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
#: arrays longer than this are skipped, not decoded (vocabularies, merges, scores)
_MAX_ARRAY = 4096
#: a model split in parts (llama.cpp's gguf-split): PREFIX-00001-of-00003.gguf, ...; llama.cpp,
#: given the first part, opens the others by these names
SPLIT_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def split_part_names(name: str) -> list[str]:
    """Every part's file name for a split model's part `name`; [name] for a single-file model."""
    m = SPLIT_NAME.match(name)
    if m is None:
        return [name]
    count = int(m["count"])
    return [f"{m['prefix']}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]


def model_stem(path: Path) -> str:
    """A model file's name without .gguf, and without the -00001-of-0000N of a split model."""
    m = SPLIT_NAME.match(path.name)
    return m["prefix"] if m else path.stem


@dataclass(frozen=True)
class ModelInfo:
    path: Path
    #: all parts together, for a split model
    size_bytes: int
    architecture: str
    name: str
    quant: str
    n_params: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_embd: int
    head_dim_k: int
    head_dim_v: int
    context_length: int
    #: sliding-window size and which layers use it (None: every layer is global)
    sliding_window: int | None
    swa_layers: tuple[bool, ...]
    chat_template: str | None
    #: set where the runtime fixes them (ONNX folders): KV bytes per element whatever the KV type,
    #: and the memory the loaded weights take when it is not the files' size
    kv_element_bytes: float | None = None
    resident_bytes: int | None = None
    #: the sampling its makers recommend (GGUF `general.sampling.*`), as SamplingParams fields
    sampling: dict = field(default_factory=dict)
    #: the feed-forward width (the widest layer's) and the vocabulary's size, which size llama.cpp's
    #: compute and output buffers and its tokenizer's tables; 0: unknown
    n_ff: int = 0
    n_vocab: int = 0

    @property
    def n_swa_layers(self) -> int:
        return sum(self.swa_layers)

    def kv_cache_bytes(self, n_ctx: int, bytes_per_element: float = 2.0, swa_full: bool = False, n_seq: int = 1) -> float:
        """KV memory for n_ctx tokens (all `n_seq` sequences together): full layers hold every
        token, sliding layers only their window (unless swa_full: then they keep every token too,
        which shifting needs)."""
        per_layer = self.n_head_kv * (self.head_dim_k + self.head_dim_v) * bytes_per_element
        total = (self.n_layer - self.n_swa_layers) * per_layer * n_ctx
        if swa_full:
            total += self.n_swa_layers * per_layer * n_ctx
        elif self.sliding_window:
            # llama.cpp keeps a window per sequence + one ubatch of cells per SWA layer, in
            # multiples of 256 (llama-kv-cache-iswa)
            swa_cells = min(n_ctx, -(-(self.sliding_window * n_seq + 512) // 256) * 256)
            total += self.n_swa_layers * per_layer * swa_cells
        return total


def _check_file(path: Path) -> None:
    if not path.exists():
        raise ModelNotFoundError(f"model file not found: {path}")
    if path.is_dir():
        raise ModelNotFoundError(f"{path} is a directory, not a model file; pass the .gguf file inside it")
    with open(path, "rb") as fh:
        magic = fh.read(4)
    if magic != GGUF_MAGIC:
        raise ModelFormatError(
            f"{path} is not a GGUF model file; edgechat runs GGUF models (convert one with: edgechat quantize)"
        )


class _Cursor:
    """Sequential reads over the mapped header; IndexError/struct.error mean truncation."""

    def __init__(self, buf):
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str):
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        if self.pos + n > len(self.buf):
            raise struct.error("string past end of file")
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def skip_string(self) -> None:
        n = self.unpack("<Q")
        self.pos += n

    def value(self, vtype: int):
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            itype, n = self.unpack("<I"), self.unpack("<Q")
            if n > _MAX_ARRAY:
                if itype == _STRING:
                    for _ in range(n):
                        self.skip_string()
                elif itype in _SCALARS:
                    self.pos += n * struct.calcsize(_SCALARS[itype])
                else:
                    raise struct.error(f"unsupported nested array type {itype}")
                return None
            return [self.value(itype) for _ in range(n)]
        raise struct.error(f"unknown GGUF value type {vtype}")


def _parse(path: Path) -> tuple[dict, int]:
    """Metadata fields, and where the last tensor's data ends (to detect truncation)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        cur = _Cursor(buf)
        cur.pos = 4
        version = cur.unpack("<I")
        if version not in (2, 3):
            raise ModelFormatError(f"{path} is GGUF version {version}; edgechat reads versions 2 and 3")
        n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
        fields = {}
        for _ in range(n_kv):
            key = cur.string()
            vtype = cur.unpack("<I")
            if key == "tokenizer.ggml.tokens" and vtype == _ARRAY:
                # the vocabulary's size, from the array's count: the array itself is skipped
                fields["_n_vocab"] = struct.unpack_from("<Q", buf, cur.pos + 4)[0]
            fields[key] = cur.value(vtype)
        data_end = 0
        for _ in range(n_tensors):
            cur.skip_string()
            n_dims = cur.unpack("<I")
            n_elements = 1
            for _ in range(n_dims):
                n_elements *= cur.unpack("<Q")
            ttype, offset = cur.unpack("<I"), cur.unpack("<Q")
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
            data_end = max(data_end, offset + n_elements // block * type_size)
            fields.setdefault("_n_params", 0)
            fields["_n_params"] += n_elements
        align = int(fields.get("general.alignment", 32))
        data_start = (cur.pos + align - 1) // align * align
    return fields, data_start + data_end


def _read_part(path: Path) -> dict:
    try:
        fields, data_end = _parse(path)
    except (struct.error, IndexError, ValueError, KeyError, OverflowError) as exc:
        raise ModelFormatError(f"{path} is a damaged or truncated GGUF file ({type(exc).__name__}); download it again") from None
    size = path.stat().st_size
    if data_end > size:
        raise ModelFormatError(f"{path} is truncated ({size} of {data_end} bytes); download it again")
    return fields


def _other_parts(path: Path, fields: dict) -> list[Path]:
    """The parts after the first of a split model (none for a single file), checked to be there."""
    count, no = int(fields.get("split.count", 1)), int(fields.get("split.no", 0))
    if count <= 1:
        return []
    names = split_part_names(path.name)
    if len(names) != count:
        raise ModelFormatError(
            f"{path} is part {no + 1} of a model split in {count}; llama.cpp finds the parts by name: "
            f"keep the names they came with (PREFIX-00001-of-{count:05d}.gguf, ...)"
        )
    if no != 0:
        raise ModelFormatError(f"{path} is part {no + 1} of {count} of a split model; pass the first part: {names[0]}")
    missing = [n for n in names[1:] if not (path.parent / n).is_file()]
    if missing:
        raise ModelNotFoundError(
            f"{path} is part 1 of {count} of a split model, and {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} missing beside it; download every part"
        )
    return [path.parent / n for n in names[1:]]


def read_model_info(path: str | Path) -> ModelInfo:
    """Parse the header (every part's, for a split model); raises a one-line ModelFormatError for
    anything llama.cpp would choke on."""
    path = Path(path)
    _check_file(path)
    fields = _read_part(path)
    size = path.stat().st_size
    for part in _other_parts(path, fields):
        _check_file(part)
        # the metadata is the first part's; the others add weights
        fields["_n_params"] = fields.get("_n_params", 0) + _read_part(part).get("_n_params", 0)
        size += part.stat().st_size
    arch = fields.get("general.architecture")
    if not arch:
        raise ModelFormatError(f"{path} has no general.architecture; it is not a model GGUF")

    def get(key: str, default=None):
        return fields.get(f"{arch}.{key}", default)

    n_layer = int(get("block_count", 0))
    n_head = get("attention.head_count", 0)
    n_head_kv = get("attention.head_count_kv", n_head)
    # per-layer arrays exist for some architectures; the planner needs one number
    if isinstance(n_head, list):
        n_head = max(n_head)
    if isinstance(n_head_kv, list):
        n_head_kv = max(n_head_kv)
    n_embd = int(get("embedding_length", 0))
    n_ff = get("feed_forward_length", 0)
    if isinstance(n_ff, list):
        n_ff = max(n_ff)
    head_k = int(get("attention.key_length", n_embd // max(int(n_head), 1)))
    head_v = int(get("attention.value_length", head_k))
    window = get("attention.sliding_window")
    swa_layers: tuple[bool, ...] = (False,) * n_layer
    if window:
        pattern = get("attention.sliding_window_pattern")
        if isinstance(pattern, list):
            swa_layers = tuple(bool(x) for x in pattern[:n_layer])
        else:
            # llama.cpp's default for Gemma 3: every 6th layer is global, the rest slide
            period = int(pattern) if pattern else (6 if arch == "gemma3" else 0)
            if period > 1:
                swa_layers = tuple((i % period) < (period - 1) for i in range(n_layer))
    from gguf import LlamaFileType

    ftype = fields.get("general.file_type")
    try:
        quant = LlamaFileType(int(ftype)).name.removeprefix("MOSTLY_") if ftype is not None else "?"
    except ValueError:
        quant = str(ftype)
    return ModelInfo(
        path=path,
        size_bytes=size,
        architecture=str(arch),
        name=str(fields.get("general.name") or model_stem(path)),
        quant=quant,
        n_params=int(fields.get("_n_params", 0)),
        n_layer=n_layer,
        n_head=int(n_head),
        n_head_kv=int(n_head_kv),
        n_embd=n_embd,
        head_dim_k=head_k,
        head_dim_v=head_v,
        context_length=int(get("context_length", 2048)),
        sliding_window=int(window) if window else None,
        swa_layers=swa_layers,
        chat_template=fields.get("tokenizer.chat_template"),
        sampling=_recommended_sampling(fields),
        n_ff=int(n_ff),
        n_vocab=int(fields.get("_n_vocab", 0)),
    )


@dataclass(frozen=True)
class ProjectorInfo:
    """What a projector (mmproj) GGUF says of itself, read like a model's header: nothing loaded."""

    path: Path
    size_bytes: int
    #: clip.projector_type, or its encoders' own (clip.vision.projector_type, clip.audio...): "gemma3", "mlp", ...
    projector_type: str
    vision: bool
    audio: bool

    @property
    def modalities(self) -> tuple[str, ...]:
        """("vision",), ("vision", "audio"), ...: as doctor and the model list say it."""
        return tuple(word for word, has in (("vision", self.vision), ("audio", self.audio)) if has)


def read_projector_info(path: str | Path) -> ProjectorInfo:
    """The header of the projector at `path`; a one-line error for a file that is missing, not a
    GGUF, damaged, or a GGUF of something else (a model given as --mmproj)."""
    path = Path(path)
    if not path.is_file():
        raise ModelNotFoundError(f"projector file not found: {path}; give the model's mmproj GGUF")
    with open(path, "rb") as fh:
        is_gguf = fh.read(4) == GGUF_MAGIC
    fields = _read_part(path) if is_gguf else {}
    if fields.get("general.architecture") != "clip":
        raise ModelFormatError(f"{path} is not a projector (mmproj) GGUF; give the mmproj file made for the model")
    # llama.cpp's older projectors are vision-only and predate the has_vision_encoder key
    audio = fields.get("clip.has_audio_encoder") is True
    vision = fields.get("clip.has_vision_encoder", not audio) is True
    kinds = dict.fromkeys(str(fields[k]) for k in ("clip.projector_type", "clip.vision.projector_type", "clip.audio.projector_type")
                          if fields.get(k))
    return ProjectorInfo(path, path.stat().st_size, "+".join(kinds) or "?", vision, audio)


#: GGUF's general.sampling keys (llama.cpp reads them as its defaults too) and the SamplingParams
#: field each sets
_SAMPLING_KEYS = {
    "temp": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "penalty_repeat": "repeat_penalty",
    "penalty_last_n": "penalty_last_n",
}


def _recommended_sampling(fields: dict) -> dict:
    out = {}
    for key, name in _SAMPLING_KEYS.items():
        limit, value = SAMPLING_LIMITS[name], fields.get(f"general.sampling.{key}")
        # a value of the wrong type or out of the engine's range is a broken header, not a setting: ignored
        if limit.accepts(value):
            out[name] = limit.check(value)
    return out
