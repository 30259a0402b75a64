"""`edgechat quantize`: a Hugging Face checkpoint to GGUF, then a quality report."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import click

from edgechat.errors import EdgechatError, UsageError

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)i?b?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'800MB', '1.5G', '700M', '123456' -> bytes (decimal units, as file managers show)."""
    m = _SIZE.match(text)
    if not m:
        raise UsageError(f"--target-size {text!r} is not a size; write it like 800MB or 1.5GB")
    return int(float(m.group(1)) * 1000 ** "_kmgt".index((m.group(2) or "_").lower()))


@click.command("quantize")
@click.argument("src", required=False)
@click.option("-o", "--output", type=click.Path(), help="Output .gguf, or folder for --format onnx (default: named after SRC, here).")
@click.option("--format", "fmt", type=click.Choice(["gguf", "onnx"]), default="gguf", show_default=True,
              help="gguf for llama.cpp, or an ONNX folder for onnxruntime (and onnxruntime-genai).")
@click.option("--bits", type=click.Choice(["4", "8", "32"]), default="4", show_default=True,
              help="--format onnx: weight bits (32: unquantized float32).")
@click.option("--block-size", type=click.Choice(["16", "32", "64", "128"]), default="32", show_default=True,
              help="--format onnx: weights per quantization block.")
@click.option("--accuracy-level", type=click.IntRange(0, 4), default=4, show_default=True,
              help="--format onnx: MatMulNBits compute type (4: int8 activations, fastest on CPUs; 0: as the input).")
@click.option("--type", "type_name", default=None, metavar="TYPE",
              help="Q4_K_M (default); Q2_K, Q3_K_S/M/L, Q4_K_S, Q5_K_S/M, Q6_K, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, "
                   "IQ4_NL, IQ4_XS, IQ3_S/M, IQ3_XS/XXS, F16, BF16; IQ2_*, IQ1_*, IQ3_XXS and Q2_K_S need --imatrix.")
@click.option("--imatrix", "imatrix_from", default=None, metavar="FILE", is_flag=False, flag_value="",
              help="Weigh quantization by an importance matrix: an imatrix GGUF (llama-imatrix's format), or a "
                   "calibration text to compute one from (alone: the built-in English/Chinese/code text).")
@click.option("--save-imatrix", type=click.Path(dir_okay=False), default=None, metavar="FILE",
              help="Also write the computed importance matrix (GGUF, readable by llama-quantize).")
@click.option("--tensor-type", "tensor_types", multiple=True, metavar="PATTERN=TYPE",
              help="Give tensors whose GGUF name matches the regex PATTERN this ggml type (repeatable).")
@click.option("--keep-output", is_flag=True, help="Leave the output layer (or a tied embedding) unquantized.")
@click.option("--token-embedding-type", default=None, metavar="TYPE", help="ggml type of the token embedding.")
@click.option("--outtype", type=click.Choice(["f16", "bf16", "f32"], case_sensitive=False), default="f16",
              show_default=True, help="Float type of unquantized tensors, and the one quantization starts from.")
@click.option("--target-size", default=None, metavar="SIZE", help="Pick the best type whose file fits SIZE (e.g. 300MB).")
@click.option("--threads", type=click.IntRange(min=1), default=None, help="CPU threads (default: all).")
@click.option("--force", is_flag=True, help="Overwrite the output file if it exists.")
@click.option("--no-report", is_flag=True, help="Skip the quality report (it converts an F16 copy to compare with).")
@click.option("--allow-requantize", is_flag=True, help="Accept a GGUF as SRC and requantize it (quality suffers).")
@click.option("--report", "report_of", type=click.Path(dir_okay=False), default=None, metavar="QUANT.gguf",
              help="Only report the quality of QUANT.gguf against --reference.")
@click.option("--reference", type=click.Path(dir_okay=False), default=None, metavar="F16.gguf",
              help="The F16 GGUF that --report compares with.")
@click.option("--compare", "compare_pair", nargs=2, type=click.Path(dir_okay=False), default=None,
              metavar="A.gguf B.gguf", help="Only answer --prompts with both models greedily and compare them.")
@click.option("--prompts", "prompts_file", type=click.Path(dir_okay=False), default=None, metavar="FILE",
              help="--compare: the prompts, one per line.")
@click.option("--eval", "eval_file", type=click.Path(dir_okay=False), default=None, metavar="FILE",
              help="After converting, compare the result with the F16 conversion on these prompts (one per line), "
                   "as --compare does.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=64, show_default=True,
              help="--compare/--eval: answer length limit.")
@click.option("--json", "as_json", is_flag=True,
              help="--compare/--eval: print the comparison as JSON for scripts (other output goes to stderr).")
def quantize_cmd(src, output, fmt, bits, block_size, accuracy_level, type_name, imatrix_from, save_imatrix, tensor_types,
                 keep_output, token_embedding_type, outtype, target_size, threads, force, no_report, allow_requantize,
                 report_of, reference, compare_pair, prompts_file, eval_file, max_tokens, as_json) -> None:
    """Convert a Hugging Face model (folder or repo id) to GGUF, without PyTorch.

    Uses llama.cpp's own quantization kernels and type mixtures, so a Q4_K_M made here is the
    Q4_K_M llama.cpp would make. Only safetensors weights are read.
    """
    from quantize import QuantizeError

    try:
        if compare_pair:
            if prompts_file is None:
                raise UsageError("--compare needs --prompts FILE (one prompt per line)")
            from quantize.compare import read_prompts

            _print_comparison(*compare_pair, read_prompts(prompts_file), max_tokens, as_json, threads)
            return
        if report_of is not None:
            if reference is None:
                raise UsageError("--report needs --reference F16.gguf to compare with")
            _print_report(report_of, reference, None, threads)
            return
        if src is None:
            raise UsageError("missing SRC: a Hugging Face model folder or repo id (see: edgechat quantize --help)")
        if fmt == "onnx":
            from edgechat.cli.quantize_onnx import export_onnx

            export_onnx(src, output, int(bits), int(block_size), accuracy_level, force, no_report, _progress)
            return
        if type_name and target_size:
            raise UsageError("give --type or --target-size, not both")
        if Path(src).suffix == ".gguf" and Path(src).is_file():
            if eval_file:
                raise UsageError("--eval compares a conversion with its F16; give a Hugging Face model as SRC")
            _requantize(Path(src), output, type_name or "Q4_K_M", threads, force, allow_requantize)
            return
        from quantize.options import ImatrixSource, overrides_from

        overrides = overrides_from(tensor_types, keep_output, token_embedding_type, outtype)
        imatrix = ImatrixSource(imatrix_from, save_imatrix) if imatrix_from is not None else None
        if save_imatrix and imatrix is None:
            raise UsageError("--save-imatrix needs --imatrix (a calibration text, or alone for the built-in one)")
        evaluation = None
        if eval_file:
            from quantize.compare import read_prompts

            evaluation = (read_prompts(eval_file), max_tokens, as_json)  # read first: a bad file stops before converting
        _convert(src, output, type_name, outtype, target_size, threads, force, no_report, imatrix, overrides, evaluation)
    except QuantizeError as exc:
        raise EdgechatError(str(exc)) from None


def _progress(label: str):
    bar = None

    def update(name: str, done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            bar = click.progressbar(length=total, label=label, file=click.get_text_stream("stderr"))
            bar.__enter__()
        bar.update(done - bar.pos)
        if name == "done":
            bar.__exit__(None, None, None)

    return update


def _convert(src, output, type_name, outtype, target_size, threads, force, no_report, imatrix, overrides,
             evaluation) -> None:
    from quantize import convert
    from quantize.mixture import file_type, is_quantized

    limit = parse_size(target_size) if target_size else None
    # The F16 conversion serves the importance matrix, the report and --eval; made next to the output, removed after.
    out_dir = Path(output).resolve().parent if output else Path.cwd()
    with tempfile.TemporaryDirectory(prefix=".edgechat-quantize-", dir=out_dir) as tmp:
        reference = None

        def f16() -> Path:
            nonlocal reference
            if reference is None:
                reference = convert(src, Path(tmp) / "reference-F16.gguf", type_name="F16", outtype=outtype,
                                    threads=threads, progress=_progress("reference F16")).path
            return reference

        matrix = imatrix.load(f16, threads) if imatrix is not None else None
        result = convert(src, output, type_name=type_name or ("Q4_K_M" if limit is None else None), outtype=outtype,
                         target_size=limit, threads=threads, force=force, progress=_progress("converting"),
                         imatrix=matrix, imatrix_source=imatrix.name if imatrix else "", overrides=overrides)
        to_stderr = evaluation is not None and evaluation[2]  # stdout holds only the JSON
        click.echo(f"wrote {result.path} ({result.arch} {result.file_type}, {result.nbytes / 1e6:.1f} MB, "
                   f"{result.n_tensors} tensors)", err=to_stderr)
        if not no_report and is_quantized(file_type(result.file_type).default):
            _print_report(result.path, f16(), result.file_type, threads, err=to_stderr)
        if evaluation is not None:
            _print_comparison(f16(), result.path, *evaluation, threads)


def _print_report(quant, reference, type_name, threads, err: bool = False) -> None:
    from quantize.report import compare

    quality = compare(quant, reference, threads=threads)
    click.echo(quality.table(), err=err)
    warning = quality.warning(type_name)
    if warning:
        click.echo(f"edgechat: warning: {warning}", err=True)


def _print_comparison(a, b, prompts: list[str], max_tokens, as_json, threads) -> None:
    import json
    import shutil
    import textwrap

    from quantize import compare

    results = compare.compare_prompts(a, b, prompts, max_tokens=max_tokens, threads=threads)
    if as_json:
        click.echo(json.dumps(compare.as_json(a, b, results), ensure_ascii=False, indent=2))
        return
    width = max(20, (shutil.get_terminal_size().columns - 3) // 2)
    for i, r in enumerate(results, 1):
        click.echo(f"[{i}] {r.prompt}")
        left, right = ([w for line in text.splitlines() or [""] for w in textwrap.wrap(line, width) or [""]]
                       for text in (r.answer_a, r.answer_b))
        click.echo(f"{'A: ' + Path(a).name:<{width}} | B: {Path(b).name}")
        for k in range(max(len(left), len(right))):
            click.echo(f"{(left[k] if k < len(left) else ''):<{width}} | {right[k] if k < len(right) else ''}")
        where = "identical answers" if r.diverges_at is None else f"first differs at answer token {r.diverges_at}"
        click.echo(f"{where}; KLD {r.mean_kld:.4f}, top-1 {100 * r.top1_agreement:.1f}% over {r.n_tokens} tokens\n")
    total = compare.summary(results)
    click.echo(f"{'prompts':<20}{total['prompts']}\n{'identical answers':<20}{total['identical_answers']}\n"
               f"{'mean KLD':<20}{total['mean_kld']:.5f}\n{'top-1 agreement':<20}{100 * total['top1_agreement']:.1f}%")


def _requantize(src: Path, output, type_name, threads, force, allow) -> None:
    from quantize import QuantizeError
    from quantize.requantize import requantize

    if not allow:
        raise UsageError(
            f"{src.name} is already a GGUF; requantizing loses quality. Convert the original checkpoint, "
            "or pass --allow-requantize"
        )
    out = Path(output) if output else src.with_name(f"{src.stem}-{type_name.upper()}.gguf")
    if out.exists() and not force:
        raise QuantizeError(f"{out} exists; pass --force to overwrite it")
    click.echo("edgechat: warning: requantizing an already quantized model loses quality", err=True)
    requantize(src, out, type_name, threads)
    click.echo(f"wrote {out} ({type_name.upper()}, {out.stat().st_size / 1e6:.1f} MB)")


def register(cli: click.Group) -> None:
    cli.add_command(quantize_cmd)
