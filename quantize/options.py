"""The quantizer's command-line choices turned into its inputs: overrides and the importance matrix."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from quantize.errors import QuantizeError
from quantize.imatrix import Imatrix, is_imatrix_file, read, write
from quantize.mixture import Overrides, file_type, tensor_type


def overrides_from(tensor_types: tuple[str, ...], keep_output: bool, token_embedding: str | None,
                   outtype: str) -> Overrides:
    pairs = []
    for item in tensor_types:
        pattern, sep, name = item.rpartition("=")
        if not sep or not pattern or not name:
            raise QuantizeError(f"--tensor-type {item!r}: write it as PATTERN=TYPE, e.g. ffn_down=q6_k")
        pairs.append((pattern, tensor_type(name)))
    return Overrides(
        tuple(pairs),
        output=file_type(outtype).default if keep_output else None,
        token_embedding=tensor_type(token_embedding) if token_embedding else None,
    )


@dataclass
class ImatrixSource:
    """--imatrix: an imatrix GGUF, a calibration text, or "" for the built-in text; --save-imatrix."""

    given: str
    save_to: str | None = None

    @property
    def name(self) -> str:
        from quantize.calibrate import BUILTIN

        return self.given or BUILTIN

    def load(self, f16: Callable[[], Path], threads: int | None) -> Imatrix:
        """The importance matrix, read or computed (running the model `f16()` returns)."""
        from quantize.calibrate import BUILTIN, builtin_text, compute

        if self.given and is_imatrix_file(self.given):
            matrix = read(self.given)
        else:
            if self.given:
                try:
                    text = Path(self.given).read_text(encoding="utf-8")
                except (OSError, UnicodeDecodeError) as exc:
                    raise QuantizeError(f"cannot read calibration text {self.given}: {exc}") from None
            else:
                text = builtin_text()
            matrix = compute(f16(), text, dataset=self.given or BUILTIN, threads=threads)
        if self.save_to:
            write(matrix, self.save_to)
        return matrix
