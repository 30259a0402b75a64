"""`edgechat quantize --format onnx`: the ONNX folder, then its quality report against the
float32 export (made next to the output and removed after)."""

from __future__ import annotations

import tempfile

import click


def export_onnx(src, output, bits: int, block_size: int, accuracy_level: int, force: bool, no_report: bool,
                progress) -> None:
    from quantize.onnx_export import compare, export

    result = export(src, output, bits=bits, block_size=block_size, accuracy_level=accuracy_level, force=force,
                    progress=progress("exporting"))
    label = "float32" if bits == 32 else f"int{bits}"
    click.echo(f"wrote {result.path}/ ({result.arch} ONNX {label}, {result.nbytes / 1e6:.1f} MB, {result.n_layers} layers)")
    if no_report or bits == 32:
        return
    with tempfile.TemporaryDirectory(prefix=".edgechat-report-", dir=result.path.parent) as tmp:
        ref = export(src, f"{tmp}/reference", bits=32, progress=progress("reference float32"))
        quality = compare(result.path, ref.path)
    click.echo(quality.table().replace("F16", "float32"))
