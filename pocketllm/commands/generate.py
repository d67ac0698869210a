"""`pocketllm generate`: greedy or sampled continuation of a prompt, or of several prompts run as
one batch."""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from pocketllm import continuation
from pocketllm.commands.ranked import run_with_model
from pocketllm.commands.settings import model_run_plan, tuple_or_none
from pocketllm.errors import UsageError
from pocketllm.inputs import PromptSource, load_tokenizer, prompt_list
from pocketllm.model_args import add_model_args, check_out_path
from pocketllm.out_file import write_out
from pocketllm.run_plan import RunPlan

# After a launcher passed rank 0 a Ctrl-C, the most the ranks get to end the run themselves: rank 0
# takes it between two ops of a step; longer means it waits in a collective a hung peer never joins.
INTERRUPT_GRACE_S = 2.0


def add_arguments(p) -> None:
    add_model_args(p)
    src = p.add_argument_group("prompt (one of)")
    src.add_argument(
        "--prompt", action="append", help="text, tokenized with the checkpoint's tokenizer.json; repeat it for several prompts, run as one batch"
    )
    src.add_argument("--prompts-file", help="text prompts, one per line, run as one batch")
    src.add_argument("--token-ids", action="append", help="comma- or space-separated token ids, e.g. 1,2,3; repeat it for several prompts")
    src.add_argument("--token-ids-file", help="file of token ids separated by commas or whitespace")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate (default 32), per prompt")
    p.add_argument("--max-running", type=int, help="with several prompts: at most this many run at once (default: all)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0: the same tokens every run; with several prompts, "
                   "prompt i draws with seed + i; rank 0 draws, every rank takes its token)")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the checkpoint's eos tokens (config.json's and generation_config.json's)")
    p.add_argument("--logits-out", help="also write the prompt's fp32 logits, every position, to this .safetensors file")
    p.add_argument(
        "--stream",
        action="store_true",
        help="print the text as each token is chosen (needs the checkpoint's tokenizer.json); the generated_ids= line follows it",
    )


@dataclass(frozen=True)
class Task:
    """generate's own settings in the run plan."""

    prompt: PromptSource
    max_running: int | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    ignore_eos: bool = False
    logits_out: str | None = None
    stream: bool = False


def _prepare(run, plan):
    t, ckpt = run.task, run.source.ckpt
    if not 0 <= t.temperature < math.inf:
        raise UsageError(f"--temperature must be a number >= 0, got {t.temperature}")
    if not -(2**63) <= t.seed < 2**63:
        raise UsageError(f"--seed must fit in 64 bits (-2**63 .. 2**63 - 1), got {t.seed}")
    if not 0 < t.top_p <= 1:
        raise UsageError(f"--top-p must be in (0, 1], got {t.top_p}")
    check_out_path(t.logits_out, "--logits-out", ckpt)
    if t.max_running is not None and t.max_running < 1:
        raise UsageError(f"--max-running must be >= 1, got {t.max_running}")
    prompts = prompt_list(t.prompt, plan.cfg, ckpt)
    if not prompts:
        raise UsageError("give a prompt: --prompt TEXT, --prompts-file FILE, --token-ids 1,2,3 or --token-ids-file FILE")
    if len(prompts) > 1:
        for flag, given in (("--stream", t.stream), ("--logits-out", t.logits_out)):
            if given:
                raise UsageError(f"{flag} takes one prompt, got {len(prompts)}")
    if t.stream:
        load_tokenizer(ckpt, "--stream", "leave --stream off to print the generated ids at the end")
    elif ckpt is not None and (Path(ckpt) / "tokenizer.json").is_file():
        load_tokenizer(ckpt)  # the text is printed after the ids: a broken tokenizer is named now, not then
    return prompts


class TextStream:
    """Rank 0's text as tokens arrive: tokenizers' DecodeStream holds back a token that ends inside
    a multi-byte character until the character completes; finish() prints what the whole output
    decodes to beyond what was streamed (such a held-back tail), so the streamed text ends equal
    to the tokenizer's decode of all the tokens. Should the stream fail or disagree with that
    decode, the stream stops and finish() prints the whole decode on a line of its own: the
    generation goes on either way. The text continues the prompt's (pocketllm.continuation)."""

    def __init__(self, tokenizer, prompt: list[int] = ()):
        self.context = continuation.context_of(tokenizer, prompt)
        self.tokenizer, self.stream, self.shown = tokenizer, continuation.stream(self.context), ""
        self.failed = False

    def __call__(self, token: int) -> None:
        if self.failed:
            return
        try:
            chunk = self.stream.step(self.tokenizer, token)
        except Exception:  # tokenizers raises its own exception types; the text comes at the end
            self.failed = True
            return
        if chunk:
            self.shown += chunk
            print(chunk, end="", flush=True)

    def finish(self, tokens: list[int]) -> None:
        full = continuation.text_after(self.tokenizer, self.context, tokens)
        if self.failed or not full.startswith(self.shown):
            print("\n" + full, flush=True)
        else:
            print(full[len(self.shown) :], flush=True)


def _work(run, plan, prompts, engine, device) -> int:
    # A rank's imports: the launcher imports this module to check, and never imports torch.
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    from pocketllm.distributed.state import tp
    from pocketllm.engine.generate import generate, generate_batch
    from pocketllm.engine.sampling import SamplingParams

    t, ckpt = run.task, run.source.ckpt
    new_tokens = t.prompt.max_new_tokens
    eos = () if t.ignore_eos else plan.cfg.eos_token_ids
    sampling = SamplingParams(t.temperature, t.top_p, t.seed)
    # A prompts file's texts are always `text=` lines, however many lines it has: a script reading
    # them cannot know the count ahead.
    listed = len(prompts) > 1 or t.prompt.prompts_file is not None
    if len(prompts) > 1:
        outputs = generate_batch(engine, prompts, new_tokens, sampling, eos, t.max_running)
        if tp().rank == 0:
            _print_outputs(ckpt, prompts, outputs, listed)
        return 0

    def save_prompt_logits(logits) -> None:
        if tp().rank == 0:
            tensors = {"logits": logits.cpu().contiguous()}

            def write(path: str) -> None:
                try:
                    save_file(tensors, path)
                except SafetensorError as exc:  # its I/O errors (a full disk) are its own type
                    raise OSError(str(exc).rsplit("I/O error: ", 1)[-1]) from None

            write_out(t.logits_out, "--logits-out", write)

    stream = TextStream(load_tokenizer(ckpt), prompts[0]) if t.stream and tp().rank == 0 else None
    got: list[int] = []  # the tokens so far, printed if Ctrl-C ends the run before its end

    def on_token(token: int) -> None:
        got.append(token)
        if stream is not None:
            stream(token)

    try:
        out = generate(engine, prompts[0], new_tokens, sampling, eos, save_prompt_logits if t.logits_out else None, on_token)
    except KeyboardInterrupt:
        if tp().rank == 0 and got:
            _print_result(ckpt, prompts[0], got, stream, listed)
            print(f"note: interrupted after {len(got)} of {new_tokens} new tokens; the results above are those", file=sys.stderr, flush=True)
        raise
    if tp().rank == 0:
        _print_result(ckpt, prompts[0], out, stream, listed)
    return 0


def _print_result(ckpt: str | None, prompt: list[int], out: list[int], stream, listed: bool) -> None:
    """One prompt's results: streamed, the text came first and the ids close it; otherwise the ids
    come first."""
    if stream is not None:
        stream.finish(out)
        print("generated_ids=" + ",".join(map(str, out)), flush=True)
        _note_ids_without_text(stream.tokenizer, out)
    else:
        _print_outputs(ckpt, [prompt], [out], listed)


def _print_outputs(ckpt: str | None, prompts: list[list[int]], outputs: list[list[int]], listed: bool) -> None:
    """One generated_ids= line per prompt in the order given, then, with a tokenizer, the texts:
    one prompt's as it decodes; several prompts' (listed) one `text=` line each, in the same
    order, as a JSON string (a text holding a newline, or none at all, would otherwise not say
    which prompt's it is). Each text is what its ids add after its prompt's."""
    for out in outputs:
        print("generated_ids=" + ",".join(map(str, out)), flush=True)
    if ckpt is None or not (Path(ckpt) / "tokenizer.json").is_file():
        return
    tok = load_tokenizer(ckpt)
    for prompt, out in zip(prompts, outputs, strict=True):
        text = continuation.text_after(tok, continuation.context_of(tok, prompt), out)
        print("text=" + json.dumps(text, ensure_ascii=False) if listed else text, flush=True)
    _note_ids_without_text(tok, [t for out in outputs for t in out])


def _note_ids_without_text(tok, ids: list[int]) -> None:
    """Ids the model may pick that tokenizer.json has no token for decode to nothing: said once, so
    that an empty text is not taken for a failure (make-checkpoint's tokenizer has a token per byte
    only, and random weights mostly pick ids past it)."""
    size = tok.get_vocab_size(with_added_tokens=True)
    past = sum(1 for t in ids if t >= size)
    if past:
        print(f"note: {past} of the {len(ids)} generated ids are past tokenizer.json's {size} tokens and show no text",
              file=sys.stderr, flush=True)


def run(args) -> int:
    prompt = PromptSource(
        tuple_or_none(args.prompt), args.prompts_file, tuple_or_none(args.token_ids), args.token_ids_file, args.max_new_tokens
    )
    task = Task(prompt, args.max_running, args.temperature, args.top_p, args.seed, args.ignore_eos, args.logits_out, args.stream)
    return execute(model_run_plan(args, task))


def execute(run: RunPlan) -> int:
    # A Ctrl-C goes to rank 0 (the launcher's ranks run in a process group of their own), which
    # prints what it generated so far, as a run at one rank does, before the others are stopped.
    return run_with_model(run, _prepare, _work, forward_signals=INTERRUPT_GRACE_S)
