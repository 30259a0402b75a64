"""Fill-in-the-middle: the prompt a code model completes at a cursor, from the text before and
after it and other files of the project, laid out as llama-server's /infill lays it out.

    [extra context]  [BOS]  FIM_PRE prefix prompt  FIM_SUF suffix  FIM_MID

The extra context is the repository-level format where the model has its tokens (FIM_REP with a
project name, then FIM_SEP and a file name before each file's text, then FIM_SEP and the current
file's name), else each file after a plain "--- snippet ---" line. Budgets follow llama.cpp's:
the prefix keeps at most 3/4 of a batch, the suffix what is left of the quarter after the prompt,
the extra context what the context holds beyond the batch (llama-server takes off twice its own
n_predict, -1 unless it was started with -n, whatever the request's: two tokens more), within
what the prompt limit leaves; each is cut at its far end (the prefix loses its start, the suffix its end, the extra context its oldest files), so
the text at the cursor always stays. The batch here never exceeds the prompt limit, so the prompt
always fits the context (llama-server builds a batch-sized prompt even into a smaller context).
"""

from __future__ import annotations

from collections.abc import Callable

from edgechat.engine.runners.vocab import FimTokens
from edgechat.engine.types.request import Infill
from edgechat.errors import UsageError

#: the names llama-server gives the project and the current file (it takes neither from the
#: request): the same prompt tokens for the same request
PROJECT_NAME = "myproject"
CURRENT_FILE = "filename"
#: a file's header where the model has no file-separator token, and a chunk's default name
SNIPPET_HEADER = "\n\n--- snippet ---\n\n"
DEFAULT_FILENAME = "tmp"


class InfillBuilder:
    """Builds a fill's prompt tokens for one model. `tokenize(text)` reads special-token text as
    plain text (a file may contain "<|fim_prefix|>"); `tokenize_special` parses it (the `prompt`,
    as llama-server does); `bos` is prepended where the model wants one."""

    def __init__(self, fim: FimTokens, *, tokenize: Callable[[str], list[int]], tokenize_special: Callable[[str], list[int]],
                 bos: int | None, n_batch: int, model_name: str = "this model"):
        self.fim = fim
        self._tokenize = tokenize
        self._tokenize_special = tokenize_special
        self.bos = bos
        self.n_batch = n_batch
        self.model_name = model_name

    def check(self) -> None:
        """Refuse a model that has no fill-in-the-middle tokens, in one line."""
        missing = self.fim.missing()
        if missing:
            raise UsageError(f"{self.model_name} cannot fill in the middle: its vocabulary has no {'/'.join(missing)} "
                             f"token; use a code model trained for it (Qwen2.5-Coder, CodeLlama, StarCoder2, ...)")

    def tokens(self, infill: Infill, n_ctx: int, limit: int) -> list[int]:
        """The prompt for `infill` in a context of `n_ctx` tokens whose prompts may take `limit`."""
        self.check()
        fim = self.fim
        extra = self._extra(infill.extra)
        prefix = self._tokenize(infill.prefix)
        suffix = self._tokenize(infill.suffix)
        prompt = self._tokenize_special(infill.prompt) if infill.prompt else []
        n_batch = min(self.n_batch, limit)
        # llama.cpp's split of a batch: 3:1 between prefix and suffix, the prompt and the two
        # markers out of the suffix's quarter
        n_prefix = min(len(prefix), 3 * (n_batch // 4))
        n_suffix = min(len(suffix), max(0, n_batch // 4 - (2 + len(prompt))))
        head = [fim.pre, *prefix[len(prefix) - n_prefix :], *prompt]
        tail = [fim.suf, *suffix[:n_suffix]]
        bos = [self.bos] if self.bos is not None else []
        fits = limit - (len(bos) + len(head) + len(tail) + 1)
        n_extra = min(len(extra), max(0, n_ctx - n_batch + 2), max(0, fits))
        return [*extra[len(extra) - n_extra :], *bos, *head, *tail, fim.mid]

    def _extra(self, chunks: tuple[tuple[str, str], ...]) -> list[int]:
        fim = self.fim
        out: list[int] = []
        if fim.rep >= 0:
            out += [fim.rep, *self._tokenize(PROJECT_NAME + "\n")]
        for filename, text in chunks:
            if fim.sep >= 0:
                out += [fim.sep, *self._tokenize(filename + "\n")]
            else:
                out += self._tokenize(SNIPPET_HEADER)
            out += self._tokenize(text)
        if fim.sep >= 0:
            out += [fim.sep, *self._tokenize(CURRENT_FILE + "\n")]
        return out
